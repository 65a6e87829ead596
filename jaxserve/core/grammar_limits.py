"""Limits on what a structured-output spec may ask for, checked when the spec is made (in the
API process, before it reaches the engine core) in time linear in its size.

A spec over a limit is a 400 naming the field and the limit (docs/security.md lists them).
They bound what the grammar compiler (llguidance, on a worker beside the engine loop) and the
per-step mask computation can be asked to do: a grammar inside them compiles in well under
the default ``--structured-outputs-compile-timeout``.
"""
from __future__ import annotations

import json
import re

from jaxserve.errors import InvalidRequestError

MAX_SPEC_BYTES = 256 * 1024  # a schema / regex / grammar / structural tag, or all choices
MAX_CHOICES = 2048  # entries of ``choice``
MAX_ENUM_VALUES = 2048  # ``enum`` values and ``const`` over a whole JSON schema
MAX_SCHEMA_DEPTH = 64  # nesting of objects and arrays in a JSON schema
MAX_REPETITION = 10_000  # a regex's counted repetitions multiplied through their nesting

_LIMITS_DOC = "docs/security.md"


def _over(param: str, what: str, n: int, limit: int) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {what} is {n}, more than the limit of {limit} "
                               f"(see {_LIMITS_DOC})", param=param)


def check_spec_limits(kind: str, value, param: str) -> None:
    """Raise naming ``param`` when a spec of ``kind`` is over a limit."""
    if kind == "choice":
        if len(value) > MAX_CHOICES:
            raise _over(param, "the number of choices", len(value), MAX_CHOICES)
        size = sum(len(c) for c in value)
        if size > MAX_SPEC_BYTES:
            raise _over(param, "the total length of the choices", size, MAX_SPEC_BYTES)
        return
    if isinstance(value, str):
        if len(value) > MAX_SPEC_BYTES:
            raise _over(param, "the length", len(value), MAX_SPEC_BYTES)
        if kind == "regex":
            check_regex(value, param)
            return
        if kind in ("json", "structural_tag"):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                return  # not JSON: the compiler's check names the field
    if isinstance(value, (dict, list)):
        check_schema(value, param)


def check_schema(schema, param: str) -> None:
    """Size, nesting, enum values and the regexes of ``pattern`` over a JSON value, walked
    without recursion."""
    size = enums = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _over(param, "the nesting depth", depth, MAX_SCHEMA_DEPTH)
        if isinstance(node, dict):
            size += 2 * len(node)
            for k, v in node.items():
                size += len(k) + 4
                if k == "enum" and isinstance(v, list):
                    enums += len(v)
                elif k == "const":
                    enums += 1
                elif k == "pattern" and isinstance(v, str):
                    check_regex(v, param)
                elif k == "patternProperties" and isinstance(v, dict):
                    for p in v:
                        check_regex(p, param)
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                else:
                    size += len(v) + 2 if isinstance(v, str) else 8
        else:
            size += 2 + len(node)
            for v in node:
                if isinstance(v, (dict, list)):
                    stack.append((v, depth + 1))
                else:
                    size += len(v) + 3 if isinstance(v, str) else 8
        if size > MAX_SPEC_BYTES:
            raise _over(param, "the size of the schema in bytes (about)", size, MAX_SPEC_BYTES)
        if enums > MAX_ENUM_VALUES:
            raise _over(param, "the number of enum / const values", enums, MAX_ENUM_VALUES)


_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def regex_repetition(pattern: str) -> int:
    """The largest product of counted repetitions (``{m}``, ``{m,n}``, ``{m,}``) along one
    nesting path of a regex: ``(a{1000}){1000}`` is 1,000,000. Patterns Python's parser does
    not read fall back to the product of every count in the pattern (an upper bound)."""
    try:
        from re import _parser as sre_parse  # noqa: PLC0415 - Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse  # type: ignore[no-redef]
    try:
        tree = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        total = 1
        for m in _COUNTED.finditer(pattern):
            total *= max(1, int(m.group(2) or m.group(1)))
            if total > MAX_REPETITION:
                break
        return total
    consts = sre_parse
    repeats = {consts.MAX_REPEAT, consts.MIN_REPEAT}
    if hasattr(consts, "POSSESSIVE_REPEAT"):
        repeats.add(consts.POSSESSIVE_REPEAT)
    unbounded = consts.MAXREPEAT

    def walk(items, depth=0) -> int:
        best = 1
        for op, av in items:
            if op in repeats:
                lo, hi, sub = av
                count = lo if hi == unbounded else hi
                best = max(best, max(1, int(count)) * walk(sub, depth + 1))
            elif op == consts.SUBPATTERN:
                best = max(best, walk(av[-1], depth + 1))
            elif op == consts.BRANCH:
                best = max([best] + [walk(b, depth + 1) for b in av[1]])
            elif op in (consts.ASSERT, consts.ASSERT_NOT):
                best = max(best, walk(av[1], depth + 1))
            if best > MAX_REPETITION:
                return best
        return best

    try:
        return walk(tree)
    except RecursionError:
        return MAX_REPETITION + 1


def check_regex(pattern: str, param: str) -> None:
    if len(pattern) > MAX_SPEC_BYTES:
        raise _over(param, "the length of a regex", len(pattern), MAX_SPEC_BYTES)
    n = regex_repetition(pattern)
    if n > MAX_REPETITION:
        raise _over(param, "a regex's nested repetition count", n, MAX_REPETITION)
