"""Outbox merging: no token lost or reordered, seq without gaps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenwire.core.outbox import DELTA, Outbox


def delta(item: str, text: str) -> dict:
    return {"type": DELTA, "response_id": "r" + item, "item_id": item, "delta": text}


def test_merges_adjacent_deltas_of_one_item() -> None:
    box = Outbox()
    box.extend([delta("a", "Hel"), delta("a", "lo"), delta("a", "!")])
    first = box.pop(merge=True)
    assert first == {**delta("a", "Hello!"), "seq": 1}
    assert box.pop(merge=True) is None
    assert box.merged == 2


def test_no_merge_below_high_water() -> None:
    box = Outbox()
    box.extend([delta("a", "x"), delta("a", "y")])
    assert box.pop()["delta"] == "x"
    assert box.pop()["delta"] == "y"


def test_never_merges_past_another_event() -> None:
    box = Outbox()
    done = {"type": "response.output_text.done", "item_id": "a"}
    box.extend([delta("a", "1"), done, delta("a", "2")])
    out = [box.pop(merge=True) for _ in range(3)]
    assert [e["type"] for e in out] == [DELTA, done["type"], DELTA]
    assert [e["seq"] for e in out] == [1, 2, 3]


events = st.lists(
    st.one_of(
        st.tuples(st.sampled_from("abc"), st.text(min_size=1, max_size=4)),
        st.just(("other", "")),
    ),
    max_size=60,
)


@given(events, st.lists(st.booleans(), min_size=1))
def test_merged_stream_equals_unmerged(spec: list[tuple[str, str]], merges: list[bool]) -> None:
    def build() -> Outbox:
        box = Outbox()
        for i, (item, text) in enumerate(spec):
            box.push(delta(item, text) if item != "other" else {"type": "x", "n": i})
        return box

    plain = build()
    plain_out = [plain.pop() for _ in range(len(spec))]
    merged = build()
    merged_out = []
    i = 0
    while (ev := merged.pop(merge=merges[i % len(merges)])) is not None:
        merged_out.append(ev)
        i += 1
    # seq is contiguous from 1.
    assert [e["seq"] for e in merged_out] == list(range(1, len(merged_out) + 1))
    # Every item's text reassembles exactly; other events keep their order.
    for item in "abc":
        want = "".join(e["delta"] for e in plain_out if e.get("item_id") == item)
        got = "".join(e["delta"] for e in merged_out if e.get("item_id") == item)
        assert got == want
    assert [e["n"] for e in plain_out if e["type"] == "x"] == [
        e["n"] for e in merged_out if e["type"] == "x"
    ]

    # No delta moves past an event that came after it.
    def positions(out: list[dict]) -> list[tuple[str, int]]:
        seen, marks = 0, []
        for e in out:
            if e["type"] == "x":
                seen += 1
            else:
                marks.append((e["item_id"], seen))
        return marks

    for item in "abc":
        plain_epochs = {s for i_, s in positions(plain_out) if i_ == item}
        merged_epochs = {s for i_, s in positions(merged_out) if i_ == item}
        assert merged_epochs <= plain_epochs


@given(events)
def test_compact_keeps_every_token_in_order(spec: list[tuple[str, str]]) -> None:
    box = Outbox()
    for i, (item, text) in enumerate(spec):
        box.push(delta(item, text) if item != "other" else {"type": "x", "n": i})
    before = list(box.queue)
    box.compact()
    out = []
    while (ev := box.pop()) is not None:
        out.append(ev)
    assert [e["seq"] for e in out] == list(range(1, len(out) + 1))
    for item in "abc":
        assert "".join(e["delta"] for e in out if e.get("item_id") == item) == "".join(
            e["delta"] for e in before if e.get("item_id") == item
        )
    assert [e["n"] for e in out if e["type"] == "x"] == [e["n"] for e in before if e["type"] == "x"]
    # At most one delta per item between two other events.
    run: list[str] = []
    for e in out:
        if e["type"] == "x":
            run = []
        else:
            assert e["item_id"] not in run
            run.append(e["item_id"])
