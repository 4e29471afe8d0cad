"""Parameter accounting: total and active-per-token parameters of any config, built on the meta device.

Convention (documented, and the one the published figures follow once their rounding is taken
into account, see tests/models/test_params.py): *active* parameters are every parameter one token's
forward pass reads - the input embedding table AND the output head (each counted in full, once if
tied), attention, all norms, dense MLPs, the router, the shared experts and ``topk`` of the
``num_experts`` routed experts of every MoE layer. *Total* counts every parameter once. The main
model excludes the MTP modules (DeepSeek-V3 "671B / 37B"); they are reported separately (their
embedding and head are the model's, so they add no embedding/head parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from moefold.models.config import ModelConfig
from moefold.models.options import ModelOptions
from moefold.parallel.dims import ParallelDims

CATEGORIES = ("attention", "norms", "mlp", "router", "shared_experts", "routed_experts", "mtp_proj",
              "hyper_connections")


@dataclass(frozen=True)
class LayerParams:
    """One block: parameters per category; ``active`` counts topk/E of the routed experts."""

    index: int
    kind: str                      # "dense" | "moe" | "mtp" | "mixer" (a mixer-only layer: Nemotron-H)
    counts: dict[str, int]
    active: int
    mixer: str = "full_attention"  # the token mixer (ModelConfig.layer_type): "attention" counts it either way

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class ParamReport:
    name: str
    embedding: int
    head: int                      # 0 when tied to the embedding
    final_norm: int
    layers: tuple[LayerParams, ...]
    mtp: tuple[LayerParams, ...]

    @property
    def total(self) -> int:
        """Main model (without MTP)."""
        return self.embedding + self.head + self.final_norm + sum(layer.total for layer in self.layers)

    @property
    def active(self) -> int:
        """Per token, main model (without MTP)."""
        return self.embedding + self.head + self.final_norm + sum(layer.active for layer in self.layers)

    @property
    def active_without_embedding(self) -> int:
        """Per token without the input embedding table (how OpenAI, Zhipu and MiniMax count their actives); a
        tied table is the head too and stays."""
        return self.active - (self.embedding if self.head else 0)

    @property
    def mtp_total(self) -> int:
        return sum(layer.total for layer in self.mtp)

    @property
    def mtp_active(self) -> int:
        return sum(layer.active for layer in self.mtp)


def _category(rest: str) -> str:
    if rest.startswith("self_attn."):
        return "attention"
    if rest.endswith("norm.weight"):
        return "norms"
    if rest.startswith("mlp.router."):
        return "router"
    if rest.startswith("mlp.experts."):
        return "routed_experts"
    if rest.startswith("mlp.shared_experts."):
        return "shared_experts"
    if rest.startswith("eh_proj."):
        return "mtp_proj"
    if rest.startswith(("attn_hc.", "ffn_hc.")):   # DeepSeek-V4's mHC coefficient maps
        return "hyper_connections"
    return "mlp"


def count_parameters(config: ModelConfig, options: ModelOptions | None = None) -> ParamReport:
    """Build ``config`` at world 1 on the meta device (no memory) and count its parameters."""
    from moefold.models.decoder import MoEDecoder  # decoder imports the MoE stack; keep this module light

    model = MoEDecoder(config, ParallelDims.single(), options or ModelOptions(), device="meta")
    per_block: dict[str, dict[str, int]] = {}
    top = {"embedding": 0, "head": 0, "final_norm": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("embed_tokens."):
            top["embedding"] += n
        elif name.startswith("output_head."):
            top["head"] += n
        elif name == "norm.weight" or name.startswith("hc_head."):   # (DeepSeek-V4: the streams' collapse first)
            top["final_norm"] += n
        else:
            head, _, rest = name.partition(".")
            idx, _, rest = rest.partition(".")
            rest = rest.removeprefix("block.")
            block = per_block.setdefault(f"{head}.{idx}", dict.fromkeys(CATEGORIES, 0))
            block[_category(rest)] += n
    fraction = config.moe_topk / config.num_experts if config.num_experts else 0.0
    layers, mtp = [], []
    for key, counts in per_block.items():
        head, idx = key.split(".")
        i = int(idx)
        active = sum(counts.values()) - counts["routed_experts"] + round(counts["routed_experts"] * fraction)
        if head == "layers":
            kind = "moe" if config.is_moe_layer(i) else "dense" if config.has_ffn(i) else "mixer"   # Nemotron-H
            mixer = config.layer_type(i) if config.v4 is None else config.v4.attention_kinds[i]
            layers.append(LayerParams(i, kind, counts, active, mixer))
        else:
            mtp.append(LayerParams(config.num_layers + i, "mtp", counts, active))
    return ParamReport(config.name, top["embedding"], top["head"], top["final_norm"],
                       tuple(sorted(layers, key=lambda x: x.index)), tuple(mtp))


def fmt_count(n: int) -> str:
    """'37.552B' / '228.432M'."""
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def format_report(report: ParamReport, per_layer: bool = True) -> str:
    """Human-readable summary; consecutive identical layers are collapsed into one row."""
    lines = [f"{report.name}: total {fmt_count(report.total)}, active per token {fmt_count(report.active)} "
             "(main model; embedding and head both counted, see models.params)"]
    if report.mtp:
        lines.append(f"  MTP modules: total {fmt_count(report.mtp_total)}, active {fmt_count(report.mtp_active)} "
                     f"(with MTP: total {fmt_count(report.total + report.mtp_total)})")
    lines.append(f"  embedding {fmt_count(report.embedding)}, output head {fmt_count(report.head)}"
                 f"{' (tied)' if report.head == 0 else ''}, final norm {report.final_norm}")
    if per_layer:
        cols = [c for c in CATEGORIES if any(layer.counts[c] for layer in report.layers + report.mtp)]
        hybrid = any(layer.mixer != "full_attention" for layer in report.layers)
        w = max([18] + [len(layer.mixer) + 2 for layer in report.layers])
        lines.append("  " + f"{'layers':<10}{'kind':<7}" + (f"{'mixer':<{w}}" if hybrid else "")
                     + "".join(f"{c:>16}" for c in cols) + f"{'total':>14}{'active':>14}")
        rows = list(report.layers) + list(report.mtp)
        start = 0
        while start < len(rows):
            end = start
            while end + 1 < len(rows) and rows[end + 1].counts == rows[start].counts \
                    and rows[end + 1].kind == rows[start].kind and rows[end + 1].mixer == rows[start].mixer:
                end += 1
            r = rows[start]
            span = f"{r.index}" if end == start else f"{r.index}-{rows[end].index}"
            lines.append("  " + f"{span:<10}{r.kind:<7}" + (f"{r.mixer:<{w}}" if hybrid else "")
                         + "".join(f"{fmt_count(r.counts[c]):>16}" for c in cols)
                         + f"{fmt_count(r.total):>14}{fmt_count(r.active):>14}"
                         + (f"  x{end - start + 1}" if end > start else ""))
            start = end + 1
    return "\n".join(lines)
