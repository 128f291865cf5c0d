"""The task templates of :mod:`dynarl.envs.python_tests`: a dozen small functions to
write, each with parameters and a generator of hidden test inputs.

A template's ``name``, ``signature``, ``description`` and ``solution`` are
``string.Template``s over the parameters its ``params`` draws; ``solution`` is the
reference implementation, the source of every expected output (run in-process, it is
this module's own code); ``inputs`` draws the argument lists of the hidden tests
(:data:`NUM_TESTS` of them, edge cases first).
"""

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

NUM_TESTS = 8
"""Hidden tests per task."""


class TaskTemplate(msgspec.Struct, frozen=True, kw_only=True):
    """One kind of task (see the module docstring for its fields)."""

    name: str
    signature: str
    description: str
    solution: str
    params: Callable[[np.random.Generator], dict[str, Any]]
    inputs: Callable[[np.random.Generator], list[list[Any]]]


def _fixed(*cases: list[Any]) -> list[list[Any]]:
    """Edge cases, written out."""
    return list(cases)


def _ints(rng: np.random.Generator, n: int, low: int, high: int) -> list[int]:
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _text(rng: np.random.Generator, alphabet: str, max_len: int) -> str:
    picks = rng.integers(0, len(alphabet), size=int(rng.integers(0, max_len + 1)))
    return "".join(alphabet[int(i)] for i in picks)


def _choice(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _palindrome(rng: np.random.Generator) -> str:
    half = _text(rng, "abcxyz", 5)
    text = half + _text(rng, "ab", 1) + half[::-1]
    return "".join(
        c.upper() if rng.random() < 0.3 else c + _choice(rng, ["", "", " ", ","]) for c in text
    )


TEMPLATES: tuple[TaskTemplate, ...] = (
    TaskTemplate(
        name="digit_sum",
        signature="digit_sum(n: int) -> int",
        description="the sum of the digits of n written in base $base (a minus sign is ignored)",
        solution="def digit_sum(n: int) -> int:\n    n = abs(n)\n    total = 0\n    while n:\n"
        "        total += n % $base\n        n //= $base\n    return total\n",
        params=lambda rng: {"base": _choice(rng, [10, 10, 2, 8])},
        inputs=lambda rng: [[0], [7], [-45]] + [[x] for x in _ints(rng, 5, -(10**6), 10**6)],
    ),
    TaskTemplate(
        name="count_vowels",
        signature="count_vowels(text: str) -> int",
        description="how many letters of text are vowels ($vowels, in upper or lower case)",
        solution="def count_vowels(text: str) -> int:\n"
        "    return sum(1 for c in text.lower() if c in '$vowels')\n",
        params=lambda rng: {"vowels": _choice(rng, ["aeiou", "aeiouy"])},
        inputs=lambda rng: (
            [[""], ["AEIOU xyz"]] + [[_text(rng, "abcdeiouyAEIOUYxz ", 20)] for _ in range(6)]
        ),
    ),
    TaskTemplate(
        name="sequence_term",
        signature="sequence_term(n: int) -> int",
        description="term n of the sequence a(0) = $a, a(1) = $b, a(n) = a(n-1) + a(n-2)",
        solution="def sequence_term(n: int) -> int:\n    a, b = $a, $b\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n",
        params=lambda rng: {"a": int(rng.integers(0, 4)), "b": int(rng.integers(1, 6))},
        inputs=lambda rng: [[0], [1], [2]] + [[x] for x in _ints(rng, 5, 3, 40)],
    ),
    TaskTemplate(
        name="is_palindrome",
        signature="is_palindrome(text: str) -> bool",
        description="whether text reads the same backwards, counting only its letters and "
        "digits and ignoring case",
        solution="def is_palindrome(text: str) -> bool:\n"
        "    kept = [c.lower() for c in text if c.isalnum()]\n    return kept == kept[::-1]\n",
        params=lambda rng: {},
        inputs=lambda rng: (
            [[""], ["A man, a plan, a canal: Panama"], ["ab"]]
            + [[_palindrome(rng)] for _ in range(3)]
            + [[_text(rng, "abc ,", 8)] for _ in range(2)]
        ),
    ),
    TaskTemplate(
        name="rotate",
        signature="rotate(items: list[int], k: int) -> list[int]",
        description="items rotated $direction by k places (k may exceed the length; an empty "
        "list stays empty)",
        solution="def rotate(items: list[int], k: int) -> list[int]:\n    if not items:\n"
        "        return []\n    k = $cut % len(items)\n    return items[k:] + items[:k]\n",
        params=lambda rng: _choice(
            rng, [{"direction": "right", "cut": "-k"}, {"direction": "left", "cut": "k"}]
        ),
        inputs=lambda rng: (
            [[[], 3], [[1, 2, 3], 0]]
            + [
                [_ints(rng, int(rng.integers(1, 9)), 0, 9), int(rng.integers(0, 13))]
                for _ in range(6)
            ]
        ),
    ),
    TaskTemplate(
        name="count_multiples",
        signature="count_multiples(low: int, high: int) -> int",
        description="how many integers from low to high (both included) are divisible by $k; "
        "0 when low > high",
        solution="def count_multiples(low: int, high: int) -> int:\n    if low > high:\n"
        "        return 0\n    return high // $k - (low - 1) // $k\n",
        params=lambda rng: {"k": int(rng.integers(2, 10))},
        inputs=lambda rng: [[5, 4], [0, 0]] + [sorted(_ints(rng, 2, -100, 1000)) for _ in range(6)],
    ),
    TaskTemplate(
        name="caesar",
        signature="caesar(text: str) -> str",
        description="text with each lowercase letter shifted $k places on in the alphabet "
        "(past z it wraps to a), every other character unchanged",
        solution="def caesar(text: str) -> str:\n    out = []\n    for c in text:\n"
        "        if 'a' <= c <= 'z':\n"
        "            c = chr((ord(c) - ord('a') + $k) % 26 + ord('a'))\n"
        "        out.append(c)\n    return ''.join(out)\n",
        params=lambda rng: {"k": int(rng.integers(1, 26))},
        inputs=lambda rng: (
            [[""], ["xyz"]]
            + [[_text(rng, "abcdefghijklmnopqrstuvwxyzAZ ,!", 16)] for _ in range(6)]
        ),
    ),
    TaskTemplate(
        name="second_$which",
        signature="second_$which(numbers: list[int]) -> int | None",
        description="the second $which distinct value in numbers, or None when there are "
        "fewer than two distinct values",
        solution="def second_$which(numbers: list[int]) -> int | None:\n"
        "    distinct = sorted(set(numbers))\n"
        "    return distinct[$at] if len(distinct) >= 2 else None\n",
        params=lambda rng: _choice(
            rng, [{"which": "largest", "at": -2}, {"which": "smallest", "at": 1}]
        ),
        inputs=lambda rng: (
            _fixed([[]], [[5, 5]], [[1, 2]])
            + [[_ints(rng, int(rng.integers(1, 9)), -20, 20)] for _ in range(5)]
        ),
    ),
    TaskTemplate(
        name="run_length",
        signature="run_length(text: str) -> str",
        description="the run-length encoding of text: each run of one character written as "
        "that character then the run's length, so 'aaab' gives 'a3b1'",
        solution="def run_length(text: str) -> str:\n    out = []\n    i = 0\n"
        "    while i < len(text):\n        j = i\n"
        "        while j < len(text) and text[j] == text[i]:\n            j += 1\n"
        "        out.append(text[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
        params=lambda rng: {},
        inputs=lambda rng: [[""], ["a"]] + [[_text(rng, "aab c", 14)] for _ in range(6)],
    ),
    TaskTemplate(
        name="collatz_steps",
        signature="collatz_steps(n: int) -> int",
        description="how many steps n (at least 1) takes to reach 1, where a step halves an "
        "even number and turns an odd one into 3 * n + 1",
        solution="def collatz_steps(n: int) -> int:\n    steps = 0\n    while n != 1:\n"
        "        n = n // 2 if n % 2 == 0 else 3 * n + 1\n        steps += 1\n    return steps\n",
        params=lambda rng: {},
        inputs=lambda rng: [[1], [2], [27]] + [[x] for x in _ints(rng, 5, 3, 10000)],
    ),
    TaskTemplate(
        name="dedupe",
        signature="dedupe(items: list[int]) -> list[int]",
        description="items without repeats, keeping the $which occurrence of each value, in "
        "the order those occurrences appear",
        solution="def dedupe(items: list[int]) -> list[int]:\n    seen = set()\n    out = []\n"
        "    for x in $order:\n        if x not in seen:\n            seen.add(x)\n"
        "            out.append(x)\n    return $result\n",
        params=lambda rng: _choice(
            rng,
            [
                {"which": "first", "order": "items", "result": "out"},
                {"which": "last", "order": "reversed(items)", "result": "out[::-1]"},
            ],
        ),
        inputs=lambda rng: (
            _fixed([[]], [[1, 1, 1]])
            + [[_ints(rng, int(rng.integers(1, 11)), 0, 5)] for _ in range(6)]
        ),
    ),
    TaskTemplate(
        name="longest_word",
        signature="longest_word(sentence: str) -> str",
        description="the longest word of sentence (words are separated by whitespace; the "
        "first one wins a tie; '' when there is none)",
        solution="def longest_word(sentence: str) -> str:\n    best = ''\n"
        "    for word in sentence.split():\n        if len(word) > len(best):\n"
        "            best = word\n    return best\n",
        params=lambda rng: {},
        inputs=lambda rng: [[""], ["a bb cc"]] + [[_text(rng, "abcd  ", 24)] for _ in range(6)],
    ),
)
"""Every template; a task draws one uniformly."""
