"""Every model family has its piece in every place: each registry keyed by family name holds an entry
for each family of fasttrain.models.families.FAMILIES, and none for a name that is not a family.
The pieces (PIECES) are what docs/design.md's "Adding a family" section lists, and the test holds
that list to this one. Beyond presence, the pieces agree with the family's facts: the rollout's
decoder is built on the family view the update uses, a mixture of experts (Family.moe) has routed
experts' terms in the plan's memory and time and a surgery that builds its expert blocks (and a
dense family none), and a family's selftest cases are cases of the selftest.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from fasttrain.models.families import FAMILIES

DESIGN = Path(__file__).resolve().parent.parent / "docs" / "design.md"

# (module, registry): the places a family has a piece in, each a dict keyed by the family's name.
PIECES: tuple[tuple[str, str], ...] = (
    ("fasttrain.models.family_view", "VIEWS"),             # the view rollout/ and train/ both drive
    ("fasttrain.models.family_surgery", "SURGERY"),        # its own surgery before the projections'
    ("fasttrain.rollout.families", "DECODERS"),            # the rollout's decoder
    ("fasttrain.train.prefix_forward", "PREFIX_FORWARDS"),  # the update's shared-prefix forward
    ("fasttrain.plan.memory", "MEMORY_TERMS"),             # the plan's memory terms
    ("fasttrain.plan.family_time", "TIME_TERMS"),          # the plan's time terms
    ("fasttrain.train.export", "EXPORTS"),                 # its export facts
    ("fasttrain.selftest.runner", "FAMILY_CASES"),         # the selftest's ops it runs
)


def registry(module: str, name: str) -> dict:
    return getattr(importlib.import_module(module), name)


def missing_pieces(families=FAMILIES, pieces=PIECES) -> list[str]:
    """One line per family lacking a piece, and per registry entry that names no family."""
    names = {f.name for f in families}
    out = []
    for module, attr in pieces:
        reg = registry(module, attr)
        out += [f"family {n!r} has no piece in {module}.{attr}" for n in sorted(names - set(reg))]
        out += [f"{module}.{attr} has an entry {n!r} that is no family" for n in sorted(set(reg) - names)]
    return out


def test_every_family_has_a_piece_in_every_registry():
    problems = missing_pieces()
    assert not problems, "\n".join(problems)


def test_a_missing_piece_is_named(monkeypatch):
    """The check fails on a family without a piece and on a stale entry (a registry with a family
    taken out, another with an extra name)."""
    decoders = registry("fasttrain.rollout.families", "DECODERS")
    monkeypatch.delitem(decoders, "qwen3_5")
    monkeypatch.setitem(registry("fasttrain.train.export", "EXPORTS"), "gpt_oss", object())
    assert missing_pieces() == ["family 'qwen3_5' has no piece in fasttrain.rollout.families.DECODERS",
                                "fasttrain.train.export.EXPORTS has an entry 'gpt_oss' that is no family"]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_the_pieces_agree_with_the_family(family):
    views, decoders = registry(*PIECES[0]), registry(*PIECES[2])
    # the rollout's decoder drives the model through the family view the update uses
    assert issubclass(decoders[family.name], views[family.name])
    assert ("linear_attention" in family.layer_kinds) == hasattr(views[family.name], "delta_inputs")
    memory, time = registry(*PIECES[4])[family.name], registry(*PIECES[5])[family.name]
    surgery = registry(*PIECES[1])[family.name]
    routed = (memory.experts is not None, time.experts is not None, surgery.built is not None,
              surgery.streamed is not None)
    assert routed == (family.moe,) * 4
    cases = registry(*PIECES[7])[family.name]
    known = registry("fasttrain.selftest.runner", "CASES")
    assert cases and set(cases) <= set(known)
    assert ("moe_experts" in cases) == family.moe
    assert ("gated_delta_rule" in cases) == ("linear_attention" in family.layer_kinds)


def test_every_selftest_op_belongs_to_some_family():
    known = registry("fasttrain.selftest.runner", "CASES")
    covered = {op for ops in registry("fasttrain.selftest.runner", "FAMILY_CASES").values() for op in ops}
    assert covered == set(known)


def test_the_design_doc_lists_exactly_these_pieces():
    text = DESIGN.read_text()
    section = re.search(r"^### Adding a family\n(.*?)(?=^#)", text, flags=re.S | re.M)
    assert section, "docs/design.md has no '### Adding a family' section"
    listed = re.findall(r"`(fasttrain(?:\.\w+)+)\.([A-Z_]+)`", section.group(1))
    assert sorted(listed) == sorted(PIECES)
