"""A token's bytes, for byte-level BPE tokenizers (GPT-2's, Llama 3's, SmolLM2's): what chat
logprobs' `bytes` show (`deploy/openai_format.py`), and whether an output's text ends inside
a character a later token may complete (`ends_inside_character`), which its decoded text
cannot tell from a U+FFFD the model wrote whole."""

from __future__ import annotations

import codecs
from typing import Any, Callable, Optional, Sequence

TokenBytes = Callable[[int], Optional[bytes]]


def byte_level_alphabet() -> list[str]:
    """Byte-level BPE's (GPT-2's) character for each byte value: printable Latin-1 stands for
    itself, the other bytes take the code points from 256 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def token_bytes(tokenizer: Any) -> Optional[TokenBytes]:
    """Token id -> its bytes for a byte-level BPE tokenizer (its vocabulary string read back
    through the alphabet above), None for an added token (written as its text); None (no
    function) for any other tokenizer."""
    from tokenizers.decoders import ByteLevel

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, ByteLevel):
        return None
    byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))

    def raw(token_id: int) -> Optional[bytes]:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if token_id in added or not isinstance(piece, str) or any(c not in byte_of for c in piece):
            return None
        return bytes(byte_of[c] for c in piece)

    return raw


def ends_inside_character(raw: TokenBytes, ids: Sequence[int]) -> bool:
    """Whether the bytes of `ids` end with the start of a UTF-8 character still incomplete
    (a later token may complete it; decoded, it reads as one U+FFFD), rather than on a whole
    character or on bytes no later one can mend (each their own U+FFFD, final). A character
    is at most 4 bytes: the last tokens' are enough, back to an added token (whole text)."""
    tail = b""
    for token_id in reversed(ids):
        piece = raw(token_id)
        if piece is None:
            break
        tail = piece + tail
        if len(tail) >= 4:
            break
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(tail, final=False)
    return bool(decoder.getstate()[0])  # the bytes it holds back for a character to come
