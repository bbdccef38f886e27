"""Real-shaped workloads for bench/gpu.py (``--workload gsm8k-1.5b | gsm8k-0.5b``) and their figures.

Everything here is pure (no GPU, no timing) so it is tested on CPU: the workload's data, tokenizer,
model folder and config, FLOP counts, the decode roofline, peak FLOP/s and memory bandwidth by device
name, and verl's ``perf/throughput``. ``--tiny`` runs the same workload at small dimensions, ``--short``
its model on a few short rows.

- **Model FLOPs**, two counts, both printed with their formula. Per token of a sequence of ``s``
  tokens, a training pass (forward + backward) costs ``6·N + 12·L·H·D·s`` and a forward pass a
  third of it (``L`` layers, ``H`` heads, ``D`` head dim; attention over the real lengths). They
  differ in ``N``: the project's counts every weight that takes part in a matrix product (the
  layers' linear maps and the LM head once, tied or not; an embedding lookup is no product),
  ``N = L·(attn + mlp) + V·h``; verl's flops counter counts the embedding and the head both,
  ``N = L·(attn + mlp) + 2·V·h`` (``V`` vocabulary, ``h`` hidden size).
- **Whole step**: generation costs a forward pass over each prompt once (the ``n`` samples of a
  prompt share its prefill) and over every response token; log-probs (and the reference's) a
  forward pass and the update a training pass per epoch over every row's prompt + response.
- **Decode roofline**: a decode step must read every weight once and each row's KV cache so far;
  the bound is the bytes of all steps over the device's memory bandwidth (compute is ignored: at
  these batch sizes decode is bandwidth-bound).
- **verl throughput** (``perf/throughput``): the step's prompt + response tokens (attention-mask
  sum) / step seconds / GPUs.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

#: Dense bf16 peak FLOP/s and HBM bandwidth (bytes/s), matched in order against the CUDA device
#: name ("NVIDIA H100 80GB HBM3" is the SXM part; the PCIe and NVL parts name themselves).
DEVICES = (("H100 PCIe", 756e12, 2.0e12), ("H100 NVL", 835e12, 3.9e12), ("H200", 989e12, 4.8e12),
           ("H100", 989e12, 3.35e12), ("A100", 312e12, 2.0e12))


@dataclass(frozen=True)
class Workload:
    """A model shape (a Hugging Face config, random weights) and a GSM8K-like batch.

    ``tokenizer_vocab``: the byte-level BPE trained for the workload (the model's vocabulary is
    larger, as Qwen's is: ids the tokenizer never produces decode to nothing).
    ``mean_response``: the mean response length, as a fraction of ``max_new_tokens``. A random-weight
    model samples near-uniformly over its vocabulary, so a stop set of ``vocab / (mean_response x
    max_new_tokens)`` ids ends a response after a geometric number of tokens with that mean: rows
    finish at different lengths, as a trained model's do, and compaction runs.
    """

    name: str
    hf_config: dict = field(hash=False)
    prompts: int = 64
    n: int = 8
    prompt_len: int = 256
    max_new_tokens: int = 512
    tokenizer_vocab: int = 4096
    mean_response: float = 0.5

    @property
    def layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def head_dim(self) -> int:
        return self.hf_config["hidden_size"] // self.heads

    @property
    def vocab(self) -> int:
        return self.hf_config["vocab_size"]

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token takes over all layers (keys and values, grouped-query heads)."""
        return 2 * self.layers * self.hf_config["num_key_value_heads"] * self.head_dim * dtype_bytes

    def stop_ids(self) -> int:
        """How many ids end a response (see the class docstring)."""
        return max(1, round(self.vocab / (self.mean_response * self.max_new_tokens)))

    def tiny(self) -> "Workload":
        """The same workload at small dimensions (CPU, tests): the same code path end to end."""
        config = qwen2_config(64, 2, 4, 2, 128, vocab=2048)
        return Workload(f"{self.name}-tiny", config, prompts=4, n=4, prompt_len=40, max_new_tokens=24,
                        tokenizer_vocab=1024, mean_response=self.mean_response)

    def short(self) -> "Workload":
        """The same model on a short batch (2 prompts x 2 samples, 48 + 8 tokens): what scales with
        the model (the roles' builds, a checkpoint, a recovery's rejoin and restore) at full size,
        in minutes on a CPU. Most rows run to the 8 tokens: their stop ids are few enough for the
        workload's tokenizer."""
        return replace(self, name=f"{self.name}-short", prompts=2, n=2, prompt_len=48, max_new_tokens=8,
                       mean_response=40.0)


def qwen2_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int = 151936) -> dict:
    """A Qwen2 ``config.json`` of this shape (a model built from it has random weights)."""
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True}


#: Shapes of Qwen2.5-1.5B and Qwen2.5-0.5B (their config.json), 64 prompts x 8 samples, up to 256 + 512.
WORKLOADS = {
    "gsm8k-1.5b": Workload("gsm8k-1.5b", qwen2_config(1536, 28, 12, 2, 8960)),
    "gsm8k-0.5b": Workload("gsm8k-0.5b", qwen2_config(896, 24, 14, 2, 4864)),
}

_WORDS = ("apples", "pens", "trains", "hours", "coins", "miles", "boxes", "cups", "days", "books", "marbles",
          "stickers", "cookies", "pencils", "tickets", "shells", "stamps", "bottles", "flowers", "chairs", "letters",
          "buttons", "candles", "plates", "shirts", "melons", "bricks", "ribbons", "puzzles", "baskets", "lemons",
          "carrots", "rockets", "wheels", "lamps", "blocks", "crayons", "muffins", "peaches", "wagons")
_NAMES = ("Tom", "Mia", "Sam", "Ana", "Lee", "Kim", "Noah", "Emma", "Liam", "Olivia", "Ethan", "Zoe", "Omar",
          "Priya", "Diego", "Hana", "Ivan", "Lucia", "Mateo", "Yuki")


def _sentence(rng: random.Random) -> str:
    return rng.choice((f"Then {rng.randint(2, 9)} {rng.choice(_WORDS)} go.",
                       f"{rng.choice(_NAMES)} gives away {rng.randint(2, 300)} {rng.choice(_WORDS)}.",
                       f"Each of the {rng.choice(_WORDS)} costs {rng.randint(2, 999)} cents, and "
                       f"{rng.randint(2, 99)} are sold on day {rng.randint(1, 30)}."))


def prepare_data(w: Workload, folder: Path, count: int, seed: int = 0) -> tuple[Path, Path]:
    """The workload's tokenizer (a byte-level BPE of ``w.tokenizer_vocab`` ids with a ChatML
    template, trained on the workload's text) and a JSONL file of ``count`` GSM8K-like problems
    with ``#### n`` answers, whose prompts (chat template applied) are between half and all of
    ``w.prompt_len`` tokens long. Returns (tokenizer folder, prompt file)."""
    from transformers import AutoTokenizer

    from resilient_rl.data.make_tokenizer import train_tokenizer

    rng = random.Random(seed)
    corpus = [" ".join(_sentence(rng) for _ in range(8)) for _ in range(2000)]
    tok_dir = train_tokenizer(corpus, folder / "tokenizer", vocab_size=w.tokenizer_vocab,
                              model_max_length=w.hf_config["max_position_embeddings"])
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)

    def length(text: str) -> int:  # tokens of the prompt as the trainer encodes it (chat template)
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        return len(tok.encode(rendered, add_special_tokens=False))

    path = folder / "prompts.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            target = rng.randint(w.prompt_len // 2, w.prompt_len)
            text = f"{rng.choice(_NAMES)} has {a} {rng.choice(_WORDS)} and buys {b} more."
            question = " How many are there now?"
            while True:
                longer = f"{text} {_sentence(rng)}"
                if length(longer + question) > target:
                    break
                text = longer
            f.write(json.dumps({"prompt": text + question, "answer": f"{a}+{b}={a + b}\n#### {a + b}"}) + "\n")
    return tok_dir, path


def workload_config(w: Workload, tokenizer: Path, prompt_file: Path, models: Path) -> dict:
    """The config (a YAML-able dict) of a GRPO run of workload ``w`` on one device, whose model is
    the folder :func:`model_folder` keeps under ``models``."""
    from transformers import AutoTokenizer

    ids = len(AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True))
    if ids - 8 < w.stop_ids():
        raise ValueError(f"workload {w.name}: its tokenizer has {ids} ids, too few for {w.stop_ids()} stop ids")
    stops = random.Random(1).sample(range(8, ids), w.stop_ids())
    return {
        "model": {"kind": "hf", "path": str(model_folder(w, stops, models)),
                  "max_seq_len": w.prompt_len + w.max_new_tokens + 8},
        "data": {"task": "jsonl", "path": str(prompt_file), "reward_fn": "gsm8k", "batch_size": w.prompts,
                 "tokenizer": str(tokenizer)},
        "rollout": {"n": w.n, "max_new_tokens": w.max_new_tokens, "temperature": 1.0},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "actor": actor_section(w),
        "trainer": {"run_name": w.name},  # bench/gpu.py adds trainer.device
    }


def model_config(w: Workload, stops: list[int]) -> dict:
    """The ``config.json`` of workload ``w``'s model, whose ``stops`` end a response."""
    return {**w.hf_config, "eos_token_id": stops}


def model_folder(w: Workload, stops: list[int], models: Path, seed: int = 0) -> Path:
    """Workload ``w``'s model as a local Hugging Face folder, which the run loads (``model.path``)
    as a real run loads its pretrained model: random weights (:func:`random_weights`) drawn from
    ``seed`` once, saved in bf16 as Qwen's own folders are, and kept under ``models`` by a digest of
    the config and seed.

    Built from ``model.hf_config`` instead, every build of the model draws its random weights
    again on the CPU: the actor's and the ref's at start, and the ref's in every process that
    replaces a killed one (the ref's 6.6 s of a 0.5 B recovery's 8.6 s rejoin on a 2-core CPU), a cost a
    run from a pretrained model does not have. The folder appears whole or not at all: it is
    written under a temporary name and renamed."""
    import torch

    from resilient_rl.models.factory import parameters_on_meta
    from resilient_rl.models.hf import load_hf_causal_lm
    from resilient_rl.workers.fsdp import materialize

    config = model_config(w, stops)
    digest = hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:16]
    folder = models / f"{w.name}-{digest}"
    if folder.is_dir():
        return folder
    models.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=models))
    try:
        with parameters_on_meta():
            model = load_hf_causal_lm(hf_config=config)
        model = materialize(model, torch.device("cpu"))  # outside: it ties the LM head to the embedding again
        random_weights(model, seed)
        model.to(torch.bfloat16).save_pretrained(partial)
        del model
        try:
            partial.rename(folder)
        except OSError:  # another process kept the same folder first
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def random_weights(model, seed: int) -> None:
    """Weights as a freshly initialised Qwen2 has them (matrices and embeddings normal with std
    0.02, norms 1, biases 0), drawn from ``seed`` where the model is, into a model built empty.
    Building it with its weights instead draws each one twice on the host CPU (torch's
    initialisation, then Hugging Face's): 20 s for 1.5 B on a 2-core CPU."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)


def actor_section(w: Workload) -> dict:
    """The actor's config of a run of workload ``w`` (bench/update_mfu.py times its update alone).

    Rows packed without padding in the log-prob, ref and update passes, as verl runs are
    (``use_remove_padding``): the rows' lengths vary, and padding would be computed too."""
    return {"ppo_epochs": 1, "mini_batch_size": w.prompts * w.n // 4, "use_kl_loss": True, "world_size": 1,
            "packing": True, "optim": {"lr": 1.0e-6}}


def device_specs(device_name: str) -> tuple[float, float] | None:
    """(dense bf16 peak FLOP/s, memory bandwidth bytes/s) by CUDA device name; None if unknown."""
    for key, peak, bandwidth in DEVICES:
        if key.lower() in device_name.lower():
            return peak, bandwidth
    return None


def dense_params(hf_config: dict) -> int:
    """Weights of the layers' linear maps (attention q, k, v, o and the gated MLP's three), biases
    left out."""
    h, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    head_dim = hf_config.get("head_dim") or h // heads
    attention = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
    return layers * (attention + 3 * h * hf_config["intermediate_size"])


def flop_params(hf_config: dict, convention: str) -> int:
    """``N`` of the FLOP count: ``project`` or ``verl`` (see the module docstring)."""
    head = hf_config["vocab_size"] * hf_config["hidden_size"]
    return dense_params(hf_config) + {"project": 1, "verl": 2}[convention] * head


def pass_flops(n_params: int, layers: int, heads: int, head_dim: int, rows: float, seq: float,
               training: bool) -> float:
    """FLOPs of one pass over ``rows`` sequences of ``seq`` tokens (see the module docstring)."""
    train = rows * (6.0 * n_params * seq + 12.0 * layers * heads * head_dim * seq * seq)
    return train if training else train / 3.0


def mfu(flops: float, seconds: float, peak: float, gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``gpus`` x ``peak``."""
    return flops / seconds / (peak * gpus)


def decode_roofline_tokens_per_s(param_bytes: float, kv_bytes_per_token: float, batch: int, prompt_len: int,
                                 new_tokens: int, bandwidth: float) -> float:
    """Output tokens/s at the memory-bandwidth bound for ``batch`` rows each generating
    ``new_tokens`` after ``prompt_len`` (every step reads the weights and every row's cache)."""
    step_bytes = sum(param_bytes + batch * (prompt_len + t) * kv_bytes_per_token for t in range(new_tokens))
    return batch * new_tokens * bandwidth / step_bytes


def verl_throughput(tokens: float, step_seconds: float, gpus: int) -> float:
    """verl's ``perf/throughput``: prompt + response tokens of the step / step time / GPUs."""
    return tokens / step_seconds / gpus


def step_shape(w: Workload, summary: dict, rows: list[dict]) -> dict:
    """Rows, mean prompt and response tokens per row of the measured steps."""
    batch = w.prompts * w.n
    response = statistics.fmean(r["response_length/mean"] for r in rows)
    return {"rows": batch, "response": response, "prompt": summary["tokens_per_step"] / batch - response}


def phase_flops(w: Workload, shape: dict, convention: str, ppo_epochs: int) -> dict[str, float]:
    """Model FLOPs of each phase of one step (see the module docstring)."""
    n = flop_params(w.hf_config, convention)
    dims = (w.layers, w.heads, w.head_dim)
    rows, prompt, response = shape["rows"], shape["prompt"], shape["response"]
    seq = prompt + response
    forward = pass_flops(n, *dims, rows, seq, training=False)
    # Each prompt's prefill once, then every response token attends over its prompt and the
    # response so far: (prompt + response) tokens of forward for the prompts, response x n for the rest.
    prefill = pass_flops(n, *dims, w.prompts, prompt, training=False)
    decode = rows * response * (2.0 * n + 4.0 * w.layers * w.heads * w.head_dim * (prompt + response / 2))
    return {"gen": prefill + decode, "old_log_prob": forward, "ref": forward,
            "update_actor": ppo_epochs * pass_flops(n, *dims, rows, seq, training=True)}


def workload_lines(w: Workload, summary: dict, rows: list[dict], peak: float | None, gpus: int,
                   ppo_epochs: int) -> list[str]:
    """The workload's figures from bench/train.py's ``summarize`` of the measured steps' rows:
    MFU per phase and for the whole step (the project's count and verl's), generation tokens/s
    inside the step, verl throughput."""
    shape = step_shape(w, summary, rows)
    phase = summary["phase_s"]
    lines = [f"workload {w.name}: {shape['rows']} rows of {shape['prompt']:.0f} prompt + {shape['response']:.0f} "
             f"response tokens (means); N = {flop_params(w.hf_config, 'project') / 1e6:.0f} M (project: layers + "
             f"LM head) / {flop_params(w.hf_config, 'verl') / 1e6:.0f} M (verl: layers + embedding + LM head)",
             "  FLOPs per pass: 6·N·s + 12·L·H·D·s² per sequence (training), a third of it forward; generation "
             "prefills each prompt once"]
    per_phase = {c: phase_flops(w, shape, c, ppo_epochs) for c in ("project", "verl")}
    for name, key in (("update", "update_actor"), ("log-prob", "old_log_prob"), ("ref log-prob", "ref"),
                      ("generation", "gen")):
        secs = phase.get(key, 0.0)
        if secs <= 0:
            continue
        value = " / ".join(f"{100 * mfu(per_phase[c][key], secs, peak, gpus):.1f}%" for c in per_phase) \
            if peak else "n/a (peak unknown)"
        lines.append(f"  {name} MFU (project / verl): {value} ({1e3 * secs:.0f} ms per step)")
    lines += allocator_lines(rows) + gradient_lines(rows)
    if peak:
        ran = [k for k in per_phase["project"] if phase.get(k, 0.0) > 0]
        whole = " / ".join(f"{100 * mfu(sum(per_phase[c][k] for k in ran), summary['step_s'], peak, gpus):.1f}%"
                           for c in per_phase)
        lines.append(f"  whole-step MFU (project / verl): {whole} over {1e3 * summary['step_s']:.0f} ms steps")
    if phase.get("gen", 0) > 0:
        lines.append(f"  generation in the step: {shape['rows'] * shape['response'] / phase['gen']:.0f} output tokens/s")
    lines.append(f"  throughput (verl perf/throughput): "
                 f"{verl_throughput(summary['tokens_per_step'], summary['step_s'], gpus):.0f} tokens/s/GPU")
    return lines


def allocator_lines(rows: list[dict]) -> list[str]:
    """The caching allocator's account of the update passes (``perf/<role>_*`` of
    :mod:`resilient_rl.workers.allocator`, on a GPU only): highest peaks against the plan's and the
    cudaMalloc retries per step, each a device-wide synchronisation of a pass planned too close to
    the device's memory."""
    lines = []
    for role in ("actor", "critic"):
        measured = [r for r in rows if f"perf/{role}_peak_bytes" in r]
        if not measured:
            continue
        gib = lambda key: max(r.get(f"perf/{role}_{key}", 0.0) for r in measured) / 2**30  # noqa: E731
        planned = f"{gib('planned_peak_bytes'):.1f} GiB planned" if any(
            f"perf/{role}_planned_peak_bytes" in r for r in measured) else "not planned"
        retries = statistics.fmean(r.get(f"perf/{role}_alloc_retries", 0.0) for r in measured)
        lines.append(f"  {role} update allocator: peak {gib('peak_bytes'):.1f} GiB allocated, "
                     f"{gib('reserved_peak_bytes'):.1f} GiB reserved ({planned}); {retries:.1f} cudaMalloc retries per step")
    return lines


def gradient_lines(rows: list[dict]) -> list[str]:
    """Whether each trained role's gradients were finite in the measured steps: the mini-batches
    whose optimizer step was skipped for a non-finite gradient (``<role>/nonfinite_skipped``) and
    the median gradient norm, one line per role."""
    lines = []
    for role in ("actor", "critic"):
        norms = [r[f"{role}/grad_norm"] for r in rows if f"{role}/grad_norm" in r]
        if not norms:
            continue
        skipped = sum(r.get(f"{role}/nonfinite_skipped", 0.0) for r in rows)
        finite = [n for n in norms if math.isfinite(n)]
        median = f"{statistics.median(finite):.4g}" if finite else "none finite"
        lines.append(f"  {role} gradients: {skipped:.0f} non-finite mini-batches skipped in {len(norms)} steps; "
                     f"grad norm median {median}")
    return lines
