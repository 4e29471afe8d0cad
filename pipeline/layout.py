"""Megatron-Core's ``--pipeline-model-parallel-layout``: what each virtual pipeline stage holds.

A layout is the list of the model's ``pp * vpp`` virtual stages in forward order (model chunk 0, 1, ...), each a
string of items: ``E`` the embedding, ``t`` one decoder layer, ``m`` one MTP layer, ``L`` the final norm, output head
and loss. The text form is Megatron's (``megatron/core/transformer/pipeline_parallel_layer_layout.py``)::

    "Et|(tt|)*30mL"      |   ends a virtual stage             x*N      N copies of one character
                         (...)*N  N copies of a group          ,        ignored (cosmetic)

so ``"Et|(tt|)*30mL"`` is 32 stages: ``Et``, 30 x ``tt``, ``mL`` (DeepSeek-V3 on PP8 x VP4). Stage ``i`` runs on
pipeline rank ``i % pp`` as its virtual stage ``i // pp`` (Megatron's round robin over pp, then vpp); with the V
placement (``zbv``, ``dualpipev``) on the rank and chunk of ``pipeline.actions.rank_and_chunk``. Decoder layers are
numbered in forward order across the stages; an empty stage passes the hidden state on.

Validity is Megatron's ``validate_layer_layout`` (one ``E``, first; one ``L``, last; ``num_layers`` ``t``;
``mtp_num_layers`` ``m``, all after the decoder layers, in one stage that is the last virtual stage of its rank) and
two rules of where Megatron builds the embedding and the loss: on the first and the last stage. Every refusal is a
ValueError that names the value and what would be valid.

``standard_layouts`` are the layouts the planner tries per pp x vpp: ``even`` (equal decoder layers, embedding on
the first stage, MTP and loss on the last), ``balanced`` (embedding, each MTP layer and the loss counted as one
decoder layer: Megatron's ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``;
it gives NVIDIA's published DeepSeek-V3 ``Et|(tt|)*30mL`` and Qwen3-235B layouts at PP8 x VP4) and ``standalone``
(the loss, and the MTP layers, on stages of their own; the rest balanced).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

ITEMS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_NAMES = {name: char for char, name in ITEMS.items()}
_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")
GRAMMAR = ("E (embedding), t (decoder layer), m (MTP layer), L (loss), | (virtual-stage boundary), x*N and (...)*N "
           "(repetition), commas (ignored)")


def parse_layout(layout: str | Sequence[Sequence[str]]) -> tuple[str, ...]:
    """Megatron's layout (text, or a list of lists of ``embedding``/``decoder``/``mtp``/``loss`` or of the letters)
    -> its virtual stages in forward order, each a string of ``E``/``t``/``m``/``L``. Only the grammar is checked
    here (``check_layout`` checks the model)."""
    if not isinstance(layout, str):
        stages = []
        for i, stage in enumerate(layout):
            if isinstance(stage, str):
                raise ValueError(f"--pipeline-model-parallel-layout as a list: stage {i} is {stage!r}, not a list "
                                 "of layer names")
            chars = []
            for item in stage:
                name = str(item).strip()
                char = _NAMES.get(name.lower(), name if name in ITEMS else None)
                if char is None:
                    raise ValueError(f"--pipeline-model-parallel-layout: {item!r} in stage {i} is not a layer; valid: "
                                     f"{', '.join(_NAMES)} (or {', '.join(ITEMS)})")
                chars.append(char)
            stages.append("".join(chars))
        return tuple(stages)
    text = layout.strip().replace(",", "")
    if not text:
        raise ValueError("--pipeline-model-parallel-layout is empty; e.g. 'Et|(tt|)*30mL' (" + GRAMMAR + ")")
    for pattern in (_GROUP, _REPEAT):   # Megatron's two passes: groups first, then single characters
        text = pattern.sub(lambda mo: mo.group(1) * int(mo.group(2)), text)
    stages = tuple(text.split("|"))
    for i, stage in enumerate(stages):
        bad = [c for c in stage if c not in ITEMS]
        if bad:
            raise ValueError(f"--pipeline-model-parallel-layout={layout!r}: character {bad[0]!r} in virtual stage "
                             f"{i} ({stage!r} after expansion) is not valid; valid: {GRAMMAR}")
    return stages


def check_layout(stages: Sequence[str], pp: int, num_layers: int, mtp_num_layers: int = 0,
                 rank_and_chunk=None, text: str | None = None) -> int:
    """Refuse (ValueError naming the numbers) a layout the model or pp cannot run; return vpp.

    ``rank_and_chunk(model_chunk) -> (pp rank, local chunk)``: the placement (default Megatron's round robin);
    ``text``: the layout as the user gave it, for the messages."""
    text = text if text is not None else format_layout(stages)
    where = f"--pipeline-model-parallel-layout={text!r}"
    n = len(stages)
    if n % pp:
        valid = ", ".join(str(pp * v) for v in (1, 2, 4) if pp * v <= max(n, pp) * 2)
        raise ValueError(f"{where} has {n} virtual stages, not a multiple of pp={pp} (each rank holds the same number "
                         f"of virtual stages: give {valid}, ... stages)")
    vpp = n // pp
    if vpp > 1 and pp < 2:
        raise ValueError(f"{where} has {n} virtual stages on pp=1: virtual stages need pp >= 2; give one stage")
    if rank_and_chunk is None:
        def rank_and_chunk(mc: int) -> tuple[int, int]:
            return mc % pp, mc // pp
    flat = "".join(stages)
    for char, want in (("E", 1), ("L", 1), ("t", num_layers), ("m", mtp_num_layers)):
        got = flat.count(char)
        if got != want:
            what = {"E": "the embedding (E) exactly once", "L": "the loss (L) exactly once",
                    "t": f"num_layers={num_layers} decoder layers (t)",
                    "m": f"mtp_num_layers={mtp_num_layers} MTP layers (m)"}[char]
            raise ValueError(f"{where} holds {got} x {char!r}; it must hold {what}")
    if not stages[0].startswith("E"):
        raise ValueError(f"{where}: the embedding must open the first virtual stage (pp rank 0, virtual stage 0, "
                         f"where Megatron builds it), got stage 0 = {stages[0]!r}")
    if not stages[-1].endswith("L"):
        raise ValueError(f"{where}: the loss must close the last virtual stage (where Megatron builds the output "
                         f"layer), got stage {n - 1} = {stages[-1]!r}")
    if mtp_num_layers:
        if "t" in flat[flat.index("m"):]:
            raise ValueError(f"{where}: decoder layers (t) must all come before the MTP layers (m)")
        holders = [i for i, s in enumerate(stages) if "m" in s]
        if len(holders) > 1:
            raise ValueError(f"{where}: all {mtp_num_layers} MTP layers must be in one virtual stage, got stages "
                             f"{holders}")
        rank, chunk = rank_and_chunk(holders[0])
        if chunk != vpp - 1:
            raise ValueError(f"{where}: the MTP layers (stage {holders[0]}: pp rank {rank}, virtual stage {chunk}) "
                             f"must be in the last virtual stage of their rank (virtual stage {vpp - 1}), as Megatron "
                             "requires")
    return vpp


def format_layout(stages: Sequence[str]) -> str:
    """The shortest-reading Megatron text of ``stages`` (``parse_layout`` inverts it): runs of 3+ equal letters as
    ``x*N``, runs of equal stages as ``(...|)*N``."""
    def stage_text(stage: str) -> str:
        return re.sub(r"(.)\1{2,}", lambda mo: f"{mo.group(1)}*{len(mo.group(0))}", stage)

    runs: list[tuple[str, int]] = []
    for stage in stages:
        if runs and runs[-1][0] == stage:
            runs[-1] = (stage, runs[-1][1] + 1)
        else:
            runs.append((stage, 1))
    out = ""
    for i, (stage, count) in enumerate(runs):
        last = i == len(runs) - 1
        body = stage_text(stage)
        if count == 1:
            out += body + ("" if last else "|")
        elif last:
            out += f"({body}|)*{count - 1}" + body
        else:
            out += f"({body}|)*{count}"
    return out


def even_layout(num_layers: int, num_stages: int, mtp_num_layers: int = 0) -> tuple[str, ...] | None:
    """``num_layers / num_stages`` decoder layers per stage, the embedding first, MTP and loss last (None when the
    layers do not divide)."""
    if num_layers % num_stages:
        return None
    per = num_layers // num_stages
    stages = ["t" * per for _ in range(num_stages)]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_num_layers + "L"
    return tuple(stages)


def _spread(units: int, stages: int) -> list[int]:
    """``units`` over ``stages`` as evenly as possible; the remainder on middle stages, evenly spaced."""
    base, extra = divmod(units, stages)
    counts = [base] * stages
    inner = list(range(1, stages - 1))
    if extra > len(inner):
        inner = list(range(stages))
    for k in range(extra):
        counts[inner[(2 * k + 1) * len(inner) // (2 * extra)]] += 1
    return counts


def balanced_layout(num_layers: int, num_stages: int, mtp_num_layers: int = 0) -> tuple[str, ...] | None:
    """Embedding, each MTP layer and the loss counted as one decoder layer, spread evenly (None if a stage would
    get fewer than none)."""
    quota = _spread(num_layers + 2 + mtp_num_layers, num_stages)
    fixed = [0] * num_stages
    fixed[0] += 1
    fixed[-1] += 1 + mtp_num_layers
    layers = [q - f for q, f in zip(quota, fixed)]
    if min(layers) < 0:
        return None
    stages = ["t" * k for k in layers]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_num_layers + "L"
    return tuple(stages)


def standalone_layout(num_layers: int, num_stages: int, mtp_num_layers: int = 0) -> tuple[str, ...] | None:
    """The loss on a last stage of its own, the MTP layers (if any) on the stage before; the embedding counted as
    one decoder layer over the others (None when too few stages remain)."""
    own = 1 + (mtp_num_layers > 0)
    rest = num_stages - own
    if rest < 1:
        return None
    quota = _spread(num_layers + 1, rest)
    quota[0] -= 1
    if min(quota) < 0:
        return None
    stages = ["t" * k for k in quota]
    stages[0] = "E" + stages[0]
    if mtp_num_layers:
        stages.append("m" * mtp_num_layers)
    stages.append("L")
    return tuple(stages)


def standard_layouts(num_layers: int, pp: int, vpp: int, mtp_num_layers: int = 0) -> dict[str, tuple[str, ...]]:
    """{name: stages} of the standard layouts at pp x vpp (module docstring), each once, each valid."""
    out: dict[str, tuple[str, ...]] = {}
    for name, build in (("even", even_layout), ("balanced", balanced_layout), ("standalone", standalone_layout)):
        stages = build(num_layers, pp * vpp, mtp_num_layers)
        if stages is None or stages in out.values():
            continue
        try:
            check_layout(stages, pp, num_layers, mtp_num_layers)
        except ValueError:
            continue
        out[name] = stages
    return out


__all__ = ["ITEMS", "GRAMMAR", "parse_layout", "check_layout", "format_layout", "even_layout", "balanced_layout",
           "standalone_layout", "standard_layouts"]
