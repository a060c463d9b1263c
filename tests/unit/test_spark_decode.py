"""bodyFormat=json decoding (pure Arrow, no Spark)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyarrow.json")

from onceq.spark.arrow import ARROW_SCHEMA
from onceq.spark.decode import BodyDecoder
from onceq.spark.options import OptionError

FIELDS = [pa.field("id", pa.string()), pa.field("n", pa.int32()),
          pa.field("labels", pa.list_(pa.string()))]


def batch(bodies: list[bytes]) -> pa.RecordBatch:
    n = len(bodies)
    cols = [pa.array(bodies, pa.binary()), *[pa.nulls(n, f.type) for f in ARROW_SCHEMA][1:]]
    return pa.RecordBatch.from_arrays(cols, schema=ARROW_SCHEMA)


def test_decoded_columns_beside_or_instead_of_the_body():
    bodies = [b'{"id":"a","n":1,"labels":["x"]}', b"oops", b'{"id":"b","n":"two"}',
              b'{\n "id": "c"\n}', b""]
    out = BodyDecoder(FIELDS, keep_body=True).apply(batch(bodies))
    assert out.schema.names == [*ARROW_SCHEMA.names, "id", "n", "labels"]
    assert out.column("id").to_pylist() == ["a", None, None, "c", None]
    assert out.column("n").to_pylist() == [1, None, None, None, None]
    assert out.column("labels").to_pylist() == [["x"], None, None, None, None]
    gone = BodyDecoder(FIELDS, keep_body=False).apply(batch(bodies))
    assert "body" not in gone.schema.names and gone.num_rows == 5
    assert BodyDecoder(FIELDS, keep_body=True).apply(batch([])).num_rows == 0


def test_dates_are_parsed_and_maps_refused():
    d = BodyDecoder([pa.field("day", pa.date32())], keep_body=True)
    got = d.decode([b'{"day": "2026-01-02"}', b'{"day": "soon"}']).column("day").to_pylist()
    assert [str(v) if v else v for v in got] == ["2026-01-02", None]
    with pytest.raises(OptionError, match="MAP columns"):
        BodyDecoder([pa.field("m", pa.map_(pa.string(), pa.string()))], keep_body=True)


def test_decoder_pickles():
    import pickle

    d = pickle.loads(pickle.dumps(BodyDecoder(FIELDS, keep_body=False)))
    assert d.schema == pa.schema(FIELDS) and not d.keep_body


values = st.fixed_dictionaries({}, optional={
    "id": st.one_of(st.none(), st.text(max_size=5)),
    "n": st.one_of(st.none(), st.integers(-2**31, 2**31 - 1), st.text(max_size=2)),
    "other": st.integers()})


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(values, st.integers(), st.text(max_size=4)), max_size=12))
def test_every_body_gives_one_row_and_valid_fields_survive(docs):
    bodies = [json.dumps(d).encode() for d in docs]
    table = BodyDecoder(FIELDS, keep_body=True).decode(bodies)
    assert table.num_rows == len(bodies)
    for doc, row in zip(docs, table.to_pylist(), strict=True):
        if not isinstance(doc, dict) or isinstance(doc.get("n"), str):
            assert row["n"] is None
        else:
            assert row == {"id": doc.get("id"), "n": doc.get("n"), "labels": None}
