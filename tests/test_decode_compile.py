"""The rollout engine's decode step compiled on CPU, through the same code a GPU runs (CUDA graphs
aside), over a whole rollout with compaction and nucleus sampling, for a grouped-query Hugging Face model (Qwen2 shape,
random weights). The compiler's own evidence: graphs compiled per batch bucket, graph breaks, and
the traced graphs themselves (no key/value expanded across query heads)."""

from __future__ import annotations

import operator

import pytest
import torch

from resilient_rl.models.decode_step import DecodeStep
from resilient_rl.models.engine import generate_static
from resilient_rl.models.hf import load_hf_causal_lm

from decode_graphs import recorded_decode_graphs

HEADS, KV_HEADS, LAYERS = 4, 2, 2
CONFIG = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": 128,
          "max_position_embeddings": 512, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def compiled_rollouts():
    """Two rollouts with compaction through the compiled step, the graphs the compiler was given,
    and the same rollouts eager."""
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config=CONFIG).eval()
    with recorded_decode_graphs() as graphs:
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(1, 64, (4, 10), generator=gen)
        mask = torch.ones_like(ids)
        ids[1, :3], mask[1, :3] = 0, 0  # prompts of different lengths, left-padded
        ids[3, :6], mask[3, :6] = 0, 0
        ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)  # 16 rows, n=4
        # First, no stop id and 10 + 150 columns: the steps read a span of 128 columns, then of
        # 256 (the cache's width, kept for the rollouts after it).
        long = dict(max_new_tokens=150, temperature=1.0, top_p=0.9, check_every=2)
        runs, eager = ([generate_static(model, ids, mask, compile=compile, generator=torch.Generator().manual_seed(4),
                                        **long)] for compile in (True, False))
        args = dict(long, max_new_tokens=40, eos_token_id=list(range(2, 10)), compact_min_fraction=0.0)
        runs += [generate_static(model, ids, mask, compile=True, generator=torch.Generator().manual_seed(s), **args)
                 for s in (1, 2)]
        eager += [generate_static(model, ids, mask, compile=False, generator=torch.Generator().manual_seed(s), **args)
                  for s in (1, 2)]
    return runs[1:] + runs[:1], eager[1:] + eager[:1], graphs


def test_one_compile_for_every_batch_bucket_and_span_and_no_graph_break(compiled_rollouts):
    runs, _, graphs = compiled_rollouts
    first, second, long = (r.engine_stats for r in runs)
    assert first["compiled"] and first["compactions"] >= 1 and len(set(first["buckets"]) - {1}) >= 2, first
    assert first["graph_breaks"] == second["graph_breaks"] == long["graph_breaks"] == 0
    # The batch and the columns read are symbols of the compiled step: the long rollout compiles
    # once for both its spans, and the others compile nothing for their buckets (a single row,
    # which the compiler specialises, may add one).
    assert long["compiles"] == 1 and long["steps"] == 149 and long["buckets"] == [16], long
    assert long["prefill_s"] > 0 and long["loop_s"] > 0  # the engine's two parts, each timed
    seen = set(first["buckets"]) | set(second["buckets"])
    assert first["compiles"] + second["compiles"] == (1 in seen), (first, second)
    assert len(graphs) == long["compiles"] + first["compiles"] + second["compiles"]
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in graphs[0].graph.nodes
               if n.op == "placeholder"), "the batch size is not an input of the compiled graph"
    assert first["eager_fallback"] is None


def test_a_step_reads_the_cache_columns_up_to_its_own_not_all_of_them(compiled_rollouts):
    """The keys a step multiplies have a symbolic column count (a span up to the step's column,
    rounded up to the block), not the cache's static width; and the long rollout, which crosses
    from the first span into the second, samples what the eager step does."""
    runs, eager, graphs = compiled_rollouts
    for gm in graphs:
        keys = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.matmul, operator.matmul)
                and len(_shape(n.args[0]) or ()) == 4][0].args[1]
        assert isinstance(keys.meta["example_value"].shape[-1], torch.SymInt), keys.format_node()
    compiled, plain = runs[2], eager[2]
    assert torch.equal(compiled.response_mask, plain.response_mask) and compiled.response_mask.all()
    assert (compiled.responses == plain.responses).float().mean() > 0.95


def test_compiled_rollout_samples_what_the_eager_one_does(compiled_rollouts):
    runs, eager, _ = compiled_rollouts
    for compiled, plain in zip(runs, eager):
        assert compiled.engine_stats["buckets"] == plain.engine_stats["buckets"]
        assert torch.equal(compiled.response_mask, plain.response_mask)
        # Same rows, same draws; tokens agree except where compiled and eager logits round apart.
        agree = (compiled.responses == plain.responses).float().mean()
        assert agree > 0.95, agree


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def test_keys_and_values_are_read_per_kv_head_not_expanded(compiled_rollouts):
    """Every attention of the compiled step multiplies the query heads of each key/value head, as
    one group, with the cache's KV_HEADS heads, and no tensor of the cache's size with HEADS heads
    (an expanded key or value) is made anywhere."""
    _, _, graphs = compiled_rollouts
    groups = HEADS // KV_HEADS
    for gm in graphs:
        products = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.matmul, operator.matmul)
                    and len(_shape(n.args[0]) or ()) == 4]
        assert len(products) == 2 * LAYERS, gm.code  # scores and weighted values, per layer
        for node in products:
            query, cache = _shape(node.args[0]), _shape(node.args[1])
            assert query[1:3] == (KV_HEADS, groups) and cache[1] == KV_HEADS, (query, cache)
        _, _, head_dim, columns = _shape(products[0].args[1])  # the keys, transposed
        expanded = (HEADS, columns, head_dim)
        offenders = [n.format_node() for n in gm.graph.nodes if (_shape(n) or ())[1:] == expanded]
        assert not offenders, offenders
        assert not [n for n in gm.graph.nodes if "repeat_interleave" in str(n.target) or "repeat_kv" in n.name]


def test_the_next_tokens_are_picked_inside_the_compiled_step(compiled_rollouts):
    """Softmax, the nucleus filter's sort and the search over the cumulative sum are in the graph
    (top_p < 1), not eager kernels around it."""
    _, _, graphs = compiled_rollouts
    for gm in graphs:
        targets = " ".join(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        assert "sort" in targets and "searchsorted" in targets and "softmax" in targets, targets



def test_graphs_left_out_of_cuda_graphs_are_counted(monkeypatch):
    """Inductor runs a graph it cannot capture in CUDA graphs without them (its log says why):
    correct, slower, and otherwise silent. A back end that skips them as inductor does (CUDA
    graphs cannot run on a CPU) shows the count in the generation's stats."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    def skipping_backend(gm, example_inputs):
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a test")
        return gm.forward

    monkeypatch.setattr(DecodeStep, "backend", skipping_backend)
    monkeypatch.setattr(DecodeStep, "_compiled", {})
    monkeypatch.setattr(DecodeStep, "failure", None)
    torch.manual_seed(0)
    model = load_hf_causal_lm(hf_config=CONFIG).eval()
    ids = torch.randint(1, 64, (4, 6), generator=torch.Generator().manual_seed(3))
    args = dict(max_new_tokens=6, temperature=1.0, check_every=2, compact_min_fraction=0.0)
    first = generate_static(model, ids, torch.ones_like(ids), compile=True, **args,
                            generator=torch.Generator().manual_seed(1)).engine_stats
    again = generate_static(model, ids, torch.ones_like(ids), compile=True, **args,
                            generator=torch.Generator().manual_seed(1)).engine_stats
    assert first["compiles"] == first["cudagraph_skips"] >= 1 and first["eager_fallback"] is None, first
    assert again["compiles"] == again["cudagraph_skips"] == 0, again
