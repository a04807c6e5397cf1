"""Tests for fxpipe.storage.json_text: program folders' JSON, one item per line to a depth."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.storage.json_text import json_text

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4) | st.integers(-3, 3), inner, max_size=4),
    max_leaves=25)


@settings(max_examples=200, deadline=None)
@given(value=values, depth=st.integers(0, 4))
def test_json_text_reads_back_as_json_dumps_writes_it(value, depth):
    try:
        expected = json.dumps(value, sort_keys=True)
    except TypeError:  # keys of several types cannot be sorted: refused alike
        with pytest.raises(TypeError):
            json_text(value, depth=depth)
        return
    assert json.loads(json_text(value, depth=depth)) == json.loads(expected)


def test_items_down_to_the_depth_have_a_line_each_and_deeper_values_stay_on_theirs():
    spec = {"stages": [{"index": 0, "recvs": []}, {"index": 1, "recvs": [{"peer": 0}]}],
            "chunks": 8, "files": {}}
    assert json_text(spec) == "\n".join([
        "{",
        '  "chunks": 8,',
        '  "files": {},',
        '  "stages": [',
        '    {"index": 0, "recvs": []},',
        '    {"index": 1, "recvs": [{"peer": 0}]}',
        "  ]",
        "}"])
    assert json_text(spec, depth=0) == json.dumps(spec, sort_keys=True)


def test_keys_are_sorted_as_json_sorts_them_and_written_as_it_writes_them():
    assert json_text({10: 1, 2: 2, True: 3}, depth=1).splitlines()[1:3] == [
        '  "true": 3,', '  "2": 2,']  # True == 1 sorts first
    assert json_text({"b": 1, "a": 2}, sort_keys=False) == '{\n  "b": 1,\n  "a": 2\n}'


def test_values_json_lacks_go_through_default_and_are_refused_without_it():
    assert json.loads(json_text({"d": {"x": object}}, default=lambda o: "obj")) == \
        {"d": {"x": "obj"}}
    with pytest.raises(TypeError):
        json_text({"d": {"x": object}})
