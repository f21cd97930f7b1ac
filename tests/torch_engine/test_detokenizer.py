"""Streaming text: at every step the text release_text holds is the tokenizer's own decode of
the output so far, and what it sends adds up to it, whether it decodes the whole output or,
with the shipped byte-level tokenizer, only the tokens after its last settled point."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest

from replicas.engine import DEFAULT_MODEL, RequestSpeculation, SamplingParams
from replicas.torch_engine.loader import load_tokenizer, resolve_model_dir
from replicas.token_bytes import byte_level_alphabet
from replicas.torch_engine.sequence import SETTLE_TOKENS, Detokenizer, Sequence, release_text

TEXT = ("Grüße aus Köln! 東京の天気は晴れです。 Emoji: 👩‍💻🚀🎉, math: ∀x∈ℝ, x²≥0. "
        "def f(x):\n    return {'ключ': x}  # комментарий\n") * 12


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL))


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream(tokenizer, detokenizer: Detokenizer, ids: list[int], seed: int, finish: str = "stop") -> str:
    """Emit `ids` in runs of 1-17 tokens (a verify step's), releasing after each, the last run
    ending the output with `finish`; the text sent."""
    rng = random.Random(seed)
    seq = Sequence("r", 0, [1], SamplingParams(max_tokens=len(ids)), RequestSpeculation(), None, frozenset())
    sent, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 17)
        seq.output_ids += ids[i:i + n]
        i += n
        if i >= len(ids):
            seq.finish_reason = finish
        delta = release_text(seq, detokenizer)
        sent += delta.text if delta is not None else ""
        assert seq.text == decode(tokenizer, seq.output_ids)
    return sent


def test_the_shipped_tokenizer_decodes_only_new_tokens(tokenizer):
    detokenizer = Detokenizer.for_tokenizer(tokenizer)
    assert detokenizer.joins
    windows = []
    counting = Detokenizer(lambda ids: windows.append(len(ids)) or detokenizer.decode(ids), joins=True)
    ids = tokenizer.encode(TEXT)
    assert stream(tokenizer, counting, ids, seed=0) == decode(tokenizer, ids)
    assert len(ids) > 20 * SETTLE_TOKENS and max(windows) < 5 * SETTLE_TOKENS  # not the whole output


@pytest.mark.parametrize("joins", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_the_decode_of_the_output(tokenizer, joins, seed):
    """Multi-byte characters split across tokens, random ids (invalid UTF-8, special tokens);
    ended by the model, or by max_tokens (which leaves out a last character it cut)."""
    rng = random.Random(seed)
    special = sorted(tokenizer.all_special_ids)
    ids = tokenizer.encode(TEXT[seed * 40:])[:600]
    ids += [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tokenizer)) for _ in range(600)]
    detokenizer = Detokenizer(lambda ids: decode(tokenizer, ids), joins)
    assert stream(tokenizer, detokenizer, ids, seed) == decode(tokenizer, ids)
    assert stream(tokenizer, detokenizer, ids, seed, "length") == decode(tokenizer, ids).rstrip("\ufffd")


def test_space_clean_up_decodes_the_whole_output(tokenizer):
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # " ." -> "." joins across any split
    assert not Detokenizer.for_tokenizer(cleaning).joins


def test_a_stop_string_matches_whole_characters_not_an_incomplete_ones_bytes(tokenizer):
    """Until its last byte comes, a character decodes to U+FFFD: a stop string "\ufffd" fired
    on an emoji's first byte. A U+FFFD the output holds still stops it."""
    detokenizer = Detokenizer.for_tokenizer(tokenizer)

    def one_token_a_step(text: str) -> Sequence:
        ids = tokenizer.encode(text)
        seq = Sequence("r", 0, [1], SamplingParams(max_tokens=len(ids), stop=("\ufffd",)), RequestSpeculation(),
                       None, frozenset())
        for token in ids:
            seq.append([token])
            release_text(seq, detokenizer)
            if seq.finish_reason is not None:
                return seq
        raise AssertionError("the output did not end")

    emoji = one_token_a_step("🐶🐱🐭")
    assert len(tokenizer.encode("🐶🐱🐭")) > 3  # characters split across tokens
    assert (emoji.finish_reason, emoji.stop_string, emoji.text) == ("length", None, "🐶🐱🐭")
    real = one_token_a_step("a\ufffdbc")
    assert (real.finish_reason, real.stop_string, real.text) == ("stop", "\ufffd", "a")
    # ended at the token that wrote it whole, not one later (QA: usage and logprobs counted "b")
    assert real.output_ids == tokenizer.encode("a\ufffd")


def test_a_u_fffd_the_model_wrote_whole_is_text_and_bytes_no_later_token_mends_are_too(tokenizer):
    """The tokens' bytes tell a U+FFFD written whole (bytes ef bf bd) or bytes no later token
    can complete (a 4-byte character's first two, interrupted) from a character still
    incomplete: those are sent as they come, kept where max_tokens cuts the output, and match a
    stop string; only the last, incomplete character's is held back (found by QA: "caf\ufffd"
    cut by max_tokens came back "caf", a run of broken emoji starts as "")."""
    detokenizer = Detokenizer.for_tokenizer(tokenizer)
    alphabet = byte_level_alphabet()
    lead = [tokenizer.convert_tokens_to_ids(alphabet[b]) for b in (0xF0, 0x9F)]  # of 🐶 and its kin

    def run(ids: list[int], finish_on_eos: bool = False) -> tuple[str, list[str]]:
        eos = frozenset({tokenizer.eos_token_id})
        seq = Sequence("r", 0, [1], SamplingParams(max_tokens=len(ids) + finish_on_eos), RequestSpeculation(),
                       None, eos)
        sent = []
        for token in ids + ([tokenizer.eos_token_id] if finish_on_eos else []):
            seq.append([token])
            sent.append((release_text(seq, detokenizer) or SimpleNamespace(text="")).text)
        assert seq.finish_reason == ("stop" if finish_on_eos else "length")
        return "".join(sent), sent

    word = tokenizer.encode("caf\ufffd")
    assert run(word) == ("caf\ufffd", ["c", "af", "\ufffd"])  # sent with its own token, kept at the cut
    assert run(lead * 3)[0] == "\ufffd\ufffd"  # the third pair is cut inside a character: left out
    assert run(lead * 3, finish_on_eos=True)[0] == "\ufffd\ufffd\ufffd"
    assert run(lead * 3)[1] == ["", "", "\ufffd", "", "\ufffd", ""]  # each pair once the next shows it broken


def test_a_character_max_tokens_cuts_inside_is_left_out_of_the_text(tokenizer):
    """Its first bytes decode to U+FFFD, which is not sent: the text ends on whole characters
    (as Anthropic's; a client sending the cut answer back as a prefill gets the character
    whole). A U+FFFD that ends an output the model ended stays."""
    detokenizer = Detokenizer.for_tokenizer(tokenizer)
    ids = tokenizer.encode("ok 🐶")
    cut = next(n for n in range(1, len(ids)) if decode(tokenizer, ids[:n]).endswith("\ufffd"))
    for split in ([ids[:cut]], [[t] for t in ids[:cut]]):  # in one step, one token a step
        seq = Sequence("r", 0, [1], SamplingParams(max_tokens=cut), RequestSpeculation(), None, frozenset())
        sent = ""
        for tokens in split:
            seq.append(tokens)
            sent += (release_text(seq, detokenizer) or SimpleNamespace(text="")).text
        assert seq.finish_reason == "length" and sent == "ok " and sent == decode(tokenizer, ids[:cut]).rstrip("\ufffd")



def test_a_last_incomplete_character_stops_alike_however_the_steps_split_the_output():
    """The U+FFFD of an output's incomplete last character matches a stop string only once the
    output is final. With the EOS a step after that character (one token a step), the stop was
    found in tokens already sent, which the search for its token skipped: the request failed.
    Now it ends as when one verify step holds the character and the EOS: the EOS cut off."""
    eos = 999
    detokenizer = Detokenizer(lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"),
                              joins=False)

    def run(steps: list[list[int]]) -> tuple:
        seq = Sequence("r", 0, [1, 2, 3], SamplingParams(max_tokens=20, stop=("\ufffd",)), RequestSpeculation(),
                       None, frozenset({eos}))
        for tokens in steps:
            seq.append(tokens)
            release_text(seq, detokenizer)
            if seq.finish_reason is not None:
                return seq.output_ids, seq.finish_reason, seq.stop_string, seq.text
        raise AssertionError("the output did not end")

    together = run([[65, 0xF0, eos]])  # "A", a 4-byte character's first byte, EOS
    assert together == ([65, 0xF0], "stop", "\ufffd", "A")
    assert run([[65], [0xF0], [eos]]) == together
    assert run([[65, 0xF0], [eos]]) == together
