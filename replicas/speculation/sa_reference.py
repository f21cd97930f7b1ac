"""A plain-Python online suffix automaton: the test oracle for the native core.

Same operations and semantics as csrc/suffix_automaton.hpp, written for obviousness rather
than speed (dict transitions, one object per state). Tests compare the native pool to this
on random token strings, and this to a brute-force scan.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _State:
    length: int  # longest string in the class, in tokens
    link: int  # suffix link; -1 for the root
    first_end: int  # index of the last token of the class's first occurrence
    next: dict[int, int] = field(default_factory=dict)


class ReferenceSuffixAutomaton:
    """Online suffix automaton over integer tokens."""

    def __init__(self, tokens: list[int] | tuple[int, ...] = ()) -> None:
        self.text: list[int] = []
        self.states: list[_State] = [_State(0, -1, -1)]
        self.last = 0
        for token in tokens:
            self.extend(token)

    def extend(self, token: int) -> None:
        """Append one token (the classic online construction)."""
        self.text.append(token)
        cur = len(self.states)
        self.states.append(_State(self.states[self.last].length + 1, 0, len(self.text) - 1))
        p = self.last
        while p != -1 and token not in self.states[p].next:
            self.states[p].next[token] = cur
            p = self.states[p].link
        if p != -1:
            q = self.states[p].next[token]
            if self.states[p].length + 1 == self.states[q].length:
                self.states[cur].link = q
            else:
                # q also holds strings that are not suffixes of the new text: split them off.
                clone = len(self.states)
                self.states.append(
                    _State(
                        self.states[p].length + 1,
                        self.states[q].link,
                        self.states[q].first_end,
                        dict(self.states[q].next),
                    )
                )
                while p != -1 and self.states[p].next.get(token) == q:
                    self.states[p].next[token] = clone
                    p = self.states[p].link
                self.states[q].link = clone
                self.states[cur].link = clone
        self.last = cur

    def longest_repeated_suffix(self) -> tuple[int, int]:
        """(match length, index of the token after the suffix's first occurrence).

        (0, -1) when no suffix of the text occurred before.
        """
        s = self.states[self.last].link
        if s <= 0:
            return 0, -1
        return self.states[s].length, self.states[s].first_end + 1

    def draft(self, k: int) -> list[int]:
        """The k tokens that followed the first occurrence, padded with -1."""
        length, pos = self.longest_repeated_suffix()
        out = self.text[pos : pos + k] if length > 0 else []
        return out + [-1] * (k - len(out))


def brute_force_longest_repeated_suffix(text: list[int]) -> tuple[int, int]:
    """O(n^2) scan: the longest suffix that also ends earlier, and its first occurrence.

    Returns (length, index after the earliest earlier end), (0, -1) if none.
    """
    n = len(text)
    best_len, best_pos = 0, -1
    for end in range(n - 1):  # an earlier occurrence ending at index `end`
        length = 0
        while length <= end and text[end - length] == text[n - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_pos = length, end + 1
    return best_len, best_pos


def z_longest_repeated_suffix(text: list[int]) -> tuple[int, int]:
    """The same answer as the brute force in O(n), for 100k-token checks.

    The Z-function of the reversed text gives, for every earlier end position, how many
    tokens the text ending there shares with the text's own end.
    """
    rev = text[::-1]
    n = len(rev)
    z = [0] * n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and rev[z[i]] == rev[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    best_len, best_pos = 0, -1
    for end in range(n - 1):  # earliest end first, so ties keep the first occurrence
        length = z[n - 1 - end]
        if length > best_len:
            best_len, best_pos = length, end + 1
    return best_len, best_pos
