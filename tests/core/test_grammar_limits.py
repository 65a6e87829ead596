"""Grammar limits (jaxserve.core.grammar_limits): checked when a spec is made, each a 400
naming the field and the limit; specs inside them pass untouched."""
from __future__ import annotations

import pytest

from jaxserve.core import grammar_limits as gl
from jaxserve.core.sampling_params import StructuredOutputsParams
from jaxserve.errors import InvalidRequestError


@pytest.mark.parametrize("pattern,n", [("(a{1000}){1000}", 1_000_000), ("a{5}b{3}", 5),
                                       ("(ab|c{20}){30}", 600), ("a*b+", 1),
                                       ("x{2,}", 2), ("(?:(?:a{10}){10}){10}", 1000)])
def test_regex_repetition_multiplies_through_nesting(pattern, n):
    assert gl.regex_repetition(pattern) == n


@pytest.mark.parametrize("kw,param,what", [
    (dict(choice=[str(i) for i in range(gl.MAX_CHOICES + 1)]), "structured_outputs.choice",
     "number of choices"),
    (dict(json={"enum": list(range(gl.MAX_ENUM_VALUES + 1))}), "structured_outputs.json",
     "enum / const values"),
    (dict(json={"properties": {f"p{i}": {"description": "x" * 64} for i in range(5000)}}),
     "structured_outputs.json", "size of the schema"),
    (dict(regex="(a{1000}){1000}"), "structured_outputs.regex", "nested repetition"),
    (dict(json={"type": "string", "pattern": "(a{200}){200}"}), "structured_outputs.json",
     "nested repetition"),
    (dict(grammar="start: " + "x" * (gl.MAX_SPEC_BYTES + 1)), "structured_outputs.grammar",
     "the length"),
])
def test_over_a_limit_is_a_400_naming_field_and_limit(kw, param, what):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == param and e.value.status_code == 400
    assert what in e.value.message and "limit" in e.value.message
    assert len(e.value.message) < 300  # the spec is never echoed


def test_deep_schema_is_refused_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidRequestError, match="nesting depth"):
        StructuredOutputsParams(json=schema)


def test_specs_inside_the_limits_pass():
    StructuredOutputsParams(choice=[f"c{i}" for i in range(gl.MAX_CHOICES)])
    StructuredOutputsParams(json={"enum": list(range(100)), "pattern": "^[0-9]{5}$"})
    StructuredOutputsParams(regex="[a-z]{3}-[0-9]{4}")
