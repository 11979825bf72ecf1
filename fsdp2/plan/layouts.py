"""``python -m fsdp2.plan --layouts``: the padding each shard layout costs a model's groups.

The dim-0 layout pads every parameter to ``W * ceil(rows / W)`` rows
(``torch.chunk``); the parameter-major layout pads only between parameters,
where a rank boundary would otherwise cut a block (whole rows, a 128 x 128
fp8 tile band, a 256-element quantization block; see [Note: Block-aligned
shards] in ``runtime/storage/block_plan.py``). Both are pure arithmetic on the
parameters' shapes, so a 671B-parameter model is planned in well under a
second per world size, without building it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.nn as nn

from ..runtime.storage.block_packing import pack_blocks
from ..runtime.storage.block_plan import Granularity, chunk_padding, plan_blocks
from ..runtime.storage.ragged_rows import choose_plan

Shapes = list[tuple[str, tuple[int, ...]]]

# A layout's planner: a group's padding at a world size (None: dim-0 chunks, no planner).
Planner = Callable[[Shapes, int], int] | None


def _blocks(granularity: Granularity) -> Planner:
    """The parameter-major plan with every parameter at ``granularity``."""

    def padding(group: Shapes, world_size: int) -> int:
        shapes, names = [s for _, s in group], [n for n, _ in group]
        return plan_blocks(shapes, [granularity] * len(group), world_size, names).padding

    return padding


def _packed(group: Shapes, world_size: int) -> int:
    """128 x 128 tiles packed (see [Note: Packed blocks] in runtime/storage/block_packing.py)."""
    shapes, names = [s for _, s in group], [n for n, _ in group]
    return pack_blocks(shapes, [(128, 128)] * len(group), world_size, names).padding


def _chosen(group: Shapes, world_size: int) -> int:
    """128 x 128 tiles as ``fully_shard`` plans them: contiguous, or packed where that pads
    much less (``choose_plan``)."""
    shapes, names = [s for _, s in group], [n for n, _ in group]
    return choose_plan(shapes, [(128, 128)] * len(group), world_size, names).padding


# The layouts the report compares, each with its planner.
LAYOUTS: tuple[tuple[str, Planner], ...] = (
    ("dim-0 chunks", None),
    ("rows", _blocks("rows")),
    ("128x128 tiles, contiguous", _blocks((128, 128))),
    ("128x128 tiles, packed", _packed),
    ("128x128 tiles (fully_shard's plan)", _chosen),
    ("256 blocks", _blocks(256)),
)


def _attention(c: dict, prefix: str) -> Shapes:
    h = c["hidden_size"]
    if "kv_lora_rank" in c:  # DeepSeek's multi-head latent attention
        heads, nope, rope = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        q_rank, kv_rank, v = c["q_lora_rank"], c["kv_lora_rank"], c["v_head_dim"]
        return [
            (f"{prefix}.q_a_proj.weight", (q_rank, h)),
            (f"{prefix}.q_a_layernorm.weight", (q_rank,)),
            (f"{prefix}.q_b_proj.weight", (heads * (nope + rope), q_rank)),
            (f"{prefix}.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)),
            (f"{prefix}.kv_a_layernorm.weight", (kv_rank,)),
            (f"{prefix}.kv_b_proj.weight", (heads * (nope + v), kv_rank)),
            (f"{prefix}.o_proj.weight", (h, heads * v)),
        ]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim") or h // heads
    shapes = [
        (f"{prefix}.q_proj.weight", (heads * head_dim, h)),
        (f"{prefix}.k_proj.weight", (kv * head_dim, h)),
        (f"{prefix}.v_proj.weight", (kv * head_dim, h)),
        (f"{prefix}.o_proj.weight", (h, heads * head_dim)),
    ]
    if c.get("model_type", "").startswith("qwen3"):  # per-head q / k norms
        shapes += [(f"{prefix}.q_norm.weight", (head_dim,)), (f"{prefix}.k_norm.weight", (head_dim,))]
    return shapes


def _mlp(h: int, inter: int, prefix: str) -> Shapes:
    return [
        (f"{prefix}.gate_proj.weight", (inter, h)),
        (f"{prefix}.up_proj.weight", (inter, h)),
        (f"{prefix}.down_proj.weight", (h, inter)),
    ]


def _feed_forward(c: dict, layer: int, prefix: str) -> Shapes:
    h = c["hidden_size"]
    experts = c.get("n_routed_experts") or c.get("num_experts") or 0
    dense_first = c.get("first_k_dense_replace", 0)
    if not experts or layer < dense_first:
        return _mlp(h, c["intermediate_size"], prefix)
    inter = c["moe_intermediate_size"]
    shapes = [(f"{prefix}.gate.weight", (experts, h))]
    if "n_routed_experts" in c:  # DeepSeek: a score bias and shared experts
        shapes.append((f"{prefix}.gate.e_score_correction_bias", (experts,)))
    for e in range(experts):
        shapes += _mlp(h, inter, f"{prefix}.experts.{e}")
    shared = c.get("n_shared_experts") or 0
    if shared:
        shapes += _mlp(h, inter * shared, f"{prefix}.shared_experts")
    return shapes


def config_groups(config: dict) -> list[Shapes]:
    """The ``fully_shard`` groups of a Hugging Face decoder config: one per layer, then the root.

    Dense Llama / Qwen and the mixture-of-experts forms of Qwen3-MoE and
    DeepSeek-V3 (experts as separate linears, as ``transformers`` builds them).
    """
    try:
        h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    except KeyError as exc:
        raise ValueError(
            f"--layouts: the config has no {exc.args[0]!r}; pass a decoder config "
            "(Llama, Qwen3, Qwen3-MoE, DeepSeek-V3) or --model"
        ) from None
    groups = []
    for i in range(layers):
        p = f"model.layers.{i}"
        groups.append(
            [(f"{p}.input_layernorm.weight", (h,))]
            + _attention(config, f"{p}.self_attn")
            + [(f"{p}.post_attention_layernorm.weight", (h,))]
            + _feed_forward(config, i, f"{p}.mlp")
        )
    root = [("model.embed_tokens.weight", (vocab, h)), ("model.norm.weight", (h,))]
    if not config.get("tie_word_embeddings", False):
        root.append(("lm_head.weight", (vocab, h)))
    groups.append(root)
    return groups


def module_groups(model: nn.Module, modules: Sequence[nn.Module]) -> list[Shapes]:
    """The groups ``fully_shard`` makes of ``model``: each of ``modules`` (deepest first), then the root."""
    names = {m: n for n, m in model.named_modules()}
    taken: set[str] = set()
    groups = []
    for module in modules:
        prefix = names[module]
        own = [
            (f"{prefix}.{n}", tuple(p.shape)) for n, p in module.named_parameters()
            if f"{prefix}.{n}" not in taken
        ]
        taken.update(n for n, _ in own)
        groups.append(own)
    groups.append([(n, tuple(p.shape)) for n, p in model.named_parameters() if n not in taken])
    return [g for g in groups if g]


@dataclass(frozen=True)
class LayoutRow:
    world_size: int
    layout: str
    padding: int  # elements, over the whole model
    numel: int
    plan_seconds: float  # planning every group (0 for dim-0 chunks)
    slowest_group_seconds: float
    largest_group: int  # parameters in the largest group

    @property
    def padding_fraction(self) -> float:
        return self.padding / max(self.numel, 1)


def layout_rows(groups: list[Shapes], world_sizes: Sequence[int]) -> list[LayoutRow]:
    """Padding and planning time of each layout in ``LAYOUTS`` at each world size."""
    numel = sum(_numel(s) for g in groups for _, s in g)
    largest = max(len(g) for g in groups)
    rows = []
    for w in world_sizes:
        for name, planner in LAYOUTS:
            if planner is None:
                pad = sum(chunk_padding([s for _, s in g], w) for g in groups)
                rows.append(LayoutRow(w, name, pad, numel, 0.0, 0.0, largest))
                continue
            pad, total, slowest = 0, 0.0, 0.0
            for g in groups:
                start = time.perf_counter()
                pad += planner(g, w)
                took = time.perf_counter() - start
                total, slowest = total + took, max(slowest, took)
            rows.append(LayoutRow(w, name, pad, numel, total, slowest, largest))
    return rows


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def layout_table(rows: list[LayoutRow]) -> str:
    """The rows as a Markdown table."""
    out = [
        "| W | layout | padding (M elements) | padding / parameters | plan time, all groups (s) "
        "| slowest group (s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        plan = "-" if r.layout == "dim-0 chunks" else f"{r.plan_seconds:.3f}"
        slowest = "-" if r.layout == "dim-0 chunks" else f"{r.slowest_group_seconds:.4f}"
        out.append(
            f"| {r.world_size} | {r.layout} | {r.padding / 1e6:,.2f} | "
            f"{100 * r.padding_fraction:.3f}% | {plan} | {slowest} |"
        )
    return "\n".join(out)
