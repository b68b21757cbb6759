"""Train the demo DiffusionGemma pair (diffusion + its AR twin: the same weights) on training/tasks.py.

    .venv/bin/python -m training.train_demo --out build/demo-hf --steps 3200 --decay-from 2400 \
        --save-every 100                                                   # the shipped run: ~3 h on 1 busy core
    .venv/bin/python -m training.train_demo --out build/smoke --steps 50   # a smoke run
    .venv/bin/python -m training.train_demo --init-gguf OLD.gguf ...       # continue from shipped weights

The model is the real architecture in miniature (Transformers' DiffusionGemmaForBlockDiffusion):
sliding and full attention layers (full layers with k_eq_v and their own head size), a shared dense
FFN plus a routed MoE in every layer, self-conditioning, separate encoder/decoder layer scalars.

One step of training, per batch (see training/README.md for why):
- diffusion loss (the paper's first stage): encoder over the chat-templated prompt fills the cache;
  each canvas gets a noise level t ~ U[0,1] and every token is replaced by a uniform vocabulary
  sample with probability t; cross-entropy of the decoder's logits to the clean canvas. On half the
  batches a first no-grad decoder pass gives logits that are fed back, temperature-scaled as the
  sampler does, as self-conditioning.
- AR loss: the encoder runs causally over prompt + answer + <eos>; next-token cross-entropy on the
  answer through the tied LM head and the softcap, so the same weights also decode autoregressively.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dgcli.errors import DgError
from dgcli.testing.tiny import tiny_vocab
from training import tasks

SEED = 20260610
CANVAS_LENGTH = tasks.CANVAS_LENGTH
# Temperatures the sampler feeds back as self-conditioning (t_max .. t_min of the defaults).
SC_TEMPERATURE_RANGE = (0.4, 0.8)
WARMUP_STEPS = 200

# Layer scalars are buffers in Transformers (fixed, not trained). Distinct, fixed values for the
# encoder and the decoder make them part of the function the model learns, so an engine that
# applies the wrong one (or none) visibly loses accuracy instead of passing by accident.
ENCODER_LAYER_SCALARS = (0.9, 0.8, 1.1, 0.7, 1.2, 1.0)
DECODER_LAYER_SCALARS = (1.1, 0.7, 0.9, 1.2, 0.8, 1.0)


# Two canvases: a canvas's sliding layers see the whole question and the canvas committed before it
# (the 26B's window is four of its canvases). The full layer sees everything.
SLIDING_WINDOW = 2 * CANVAS_LENGTH


def demo_config(hidden_size: int = 128):
    """The demo model's Transformers config: 6 layers (5 sliding : 1 full, as the 26B), 4 experts top-2."""
    from transformers.models.diffusion_gemma import DiffusionGemmaConfig

    vocab = tiny_vocab()
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    text_config = dict(
        vocab_size=vocab.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        layer_types=layer_types,
        sliding_window=SLIDING_WINDOW,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=hidden_size // 2,
        max_position_embeddings=1024,
        final_logit_softcapping=30.0,
        pad_token_id=vocab.pad_id,
        eos_token_id=vocab.eos_id,
        bos_token_id=vocab.bos_id,
        tie_word_embeddings=True,
    )
    # Transformers always builds a vision tower (its default is ~170M parameters). The demo is text
    # only and the converter drops vision tensors, so make it as small as the config allows.
    vision_config = dict(model_type="gemma4_vision", hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=8, patch_size=2,
                         position_embedding_size=8)
    return DiffusionGemmaConfig(text_config=text_config, vision_config=vision_config,
                                canvas_length=CANVAS_LENGTH, tie_word_embeddings=True)


def build_model(seed: int = SEED, hidden_size: int = 128):
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    config = demo_config(hidden_size)
    config._attn_implementation = "sdpa"
    model = DiffusionGemmaForBlockDiffusion(config)
    encoder_layers = model.model.encoder.language_model.layers
    decoder_layers = model.model.decoder.layers
    with torch.no_grad():
        for layer, value in zip(encoder_layers, ENCODER_LAYER_SCALARS):
            layer.layer_scalar.fill_(value)
        for layer, value in zip(decoder_layers, DECODER_LAYER_SCALARS):
            layer.layer_scalar.fill_(value)
    vocab = tiny_vocab()
    model.generation_config.eos_token_id = list(vocab.end_token_ids)
    model.generation_config.pad_token_id = vocab.pad_id
    model.generation_config.bos_token_id = vocab.bos_id
    return model


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and a 0/1 mask. RoPE only sees relative offsets, so left padding leaves every
    real token's attention exactly as in an unpadded batch-1 run (what the engine does)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def make_batch(rng: random.Random, batch_size: int, ar_rows: int) -> dict:
    """One training batch. Each example trains one of its answer's canvases, chosen at random: canvas k
    is conditioned on the question plus the k clean canvases before it (what generation commits to the
    cache), so answers longer than a canvas teach commit-and-continue. The first `ar_rows` examples
    also give the AR objective over question + whole answer + <eos>."""
    vocab = tiny_vocab()
    examples = [tasks.sample_example(rng, held_out=False) for _ in range(batch_size)]
    prompts = [tasks.prompt_ids(e, vocab) for e in examples]
    answers = [tasks.answer_ids(e, vocab) for e in examples]
    canvas_index = [rng.randrange(tasks.canvas_count(e, CANVAS_LENGTH, vocab)) for e in examples]
    contexts = [p + a[:k * CANVAS_LENGTH] for p, a, k in zip(prompts, answers, canvas_index)]
    context_ids, context_mask = _left_pad(contexts, vocab.pad_id)
    canvas = torch.tensor([tasks.canvas_ids(e, k, CANVAS_LENGTH, vocab) for e, k in zip(examples, canvas_index)])
    # AR sequence: prompt + answer + <eos>, left-padded; targets only on the answer (incl. <eos>).
    full_ids, full_mask = _left_pad([p + a for p, a in zip(prompts[:ar_rows], answers[:ar_rows])], vocab.pad_id)
    ar_targets = torch.full_like(full_ids, -100)
    for i, a in enumerate(answers[:ar_rows]):
        width = full_ids.shape[1]
        # position j predicts token j+1: the answer's tokens are predicted from the positions before them
        ar_targets[i, width - len(a) - 1: width - 1] = torch.tensor(a)
    return dict(prompt_ids=context_ids, prompt_mask=context_mask, canvas=canvas,
                full_ids=full_ids, full_mask=full_mask, ar_targets=ar_targets,
                tasks=[e.task for e in examples])


def softcapped_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    cap = model.final_logit_softcapping
    return torch.tanh(model.lm_head(hidden).float() / cap) * cap


def noise_canvas(canvas: torch.Tensor, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """Per canvas t ~ U[0,1]; each token replaced by a uniform vocabulary sample with probability t."""
    batch, length = canvas.shape
    t = torch.rand(batch, 1, generator=generator)
    replace = torch.rand(batch, length, generator=generator) < t
    random_tokens = torch.randint(0, vocab_size, (batch, length), generator=generator)
    return torch.where(replace, random_tokens, canvas)


def losses(model, batch: dict, generator: torch.Generator, self_condition: bool,
           ar_weight: float) -> dict[str, torch.Tensor]:
    """Diffusion (+ AR) loss of one batch; also the diffusion loss per task (detached, for the log)."""
    from transformers.cache_utils import DynamicCache

    text_config = model.config.text_config
    cache = DynamicCache(config=text_config)
    model.model.encoder(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], past_key_values=cache)
    noisy = noise_canvas(batch["canvas"], text_config.vocab_size, generator)
    decoder_mask = F.pad(batch["prompt_mask"], (0, CANVAS_LENGTH), value=1)

    def decode(sc_logits):
        out = model(decoder_input_ids=noisy, past_key_values=cache, decoder_attention_mask=decoder_mask,
                    self_conditioning_logits=sc_logits)
        return out.logits

    sc_logits = None
    if self_condition:
        with torch.no_grad():
            first = decode(None)
            low, high = SC_TEMPERATURE_RANGE
            temperature = low + (high - low) * torch.rand(first.shape[0], 1, 1, generator=generator)
            sc_logits = first / temperature
    logits = decode(sc_logits)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["canvas"].reshape(-1), reduction="none")
    per_row = per_token.view(batch["canvas"].shape).mean(dim=1)
    result = {"diffusion": per_row.mean()}
    if ar_weight > 0 and batch["full_ids"].shape[0]:
        encoded = model.model.encoder(input_ids=batch["full_ids"], attention_mask=batch["full_mask"], use_cache=False)
        ar_logits = softcapped_logits(model, encoded.last_hidden_state)
        result["ar"] = F.cross_entropy(ar_logits.reshape(-1, ar_logits.shape[-1]), batch["ar_targets"].reshape(-1),
                                       ignore_index=-100)
    result["total"] = result["diffusion"] + ar_weight * result.get("ar", 0.0)
    for name in set(batch["tasks"]):
        rows = torch.tensor([t == name for t in batch["tasks"]])
        result[f"diffusion_{name}"] = per_row.detach()[rows].mean()
    return result


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def train(out_dir: Path, steps: int, batch_size: int, lr: float, ar_weight: float, seed: int,
          threads: int, hidden_size: int, log_every: int = 50, save_every: int = 0,
          stop_after: int | None = None, ar_fraction: float = 0.25, decay_fraction: float = 0.2,
          decay_from: int | None = None, init_gguf: Path | None = None, warmup_steps: int | None = None) -> Path:
    """Train (or resume from out_dir/train_state.pt, written every `save_every` steps) and save the
    HF checkpoint. A resumed run continues the same data and noise streams, so it ends where an
    uninterrupted run would. `init_gguf` starts from an F32 demo GGUF's weights instead of the
    seeded initialisation (a fine-tune; the optimizer starts fresh, hence its own warm-up)."""
    torch.set_num_threads(threads)
    warmup_steps = WARMUP_STEPS if warmup_steps is None else warmup_steps
    model = build_model(seed, hidden_size)
    if init_gguf is not None:
        from training.gguf_weights import load_gguf_weights

        load_gguf_weights(model, init_gguf)
    model.train()
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    ar_rows = round(batch_size * ar_fraction) if ar_weight > 0 else 0
    if decay_from is None:
        decay_from = steps - round(steps * decay_fraction)
    if not 0 <= decay_from <= steps:
        raise SystemExit(f"--decay-from {decay_from} must lie between 0 and --steps ({steps})")
    run = dict(seed=seed, hidden_size=hidden_size, batch_size=batch_size, lr=lr, ar_weight=ar_weight,
               ar_fraction=ar_fraction, warmup_steps=warmup_steps,
               init_gguf_sha256=file_sha256(init_gguf) if init_gguf else None)  # what a resumed state must match

    def lr_at(step: int) -> float:
        """Warm-up, constant, then a cosine decay over the last `decay_fraction` of the steps to 5%.
        Until the decay starts the rate does not depend on `steps`, so a run can be resumed with a
        larger --steps and ends exactly as a fresh run with that --steps would."""
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        if step < decay_from:
            return lr
        progress = (step - decay_from) / max(1, steps - decay_from)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "train_log.jsonl"
    state_path = out_dir / "train_state.pt"
    first_step, running, elapsed_before = 0, {}, 0.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        # states written before the warm-up and the initial weights were options had the defaults
        state["run"] = {"warmup_steps": WARMUP_STEPS, "init_gguf_sha256": None, **state["run"]}
        if state["run"] != run:
            raise SystemExit(f"{state_path} is from another run ({state['run']}); use another --out")
        schedule_changed = (state["steps"], state["decay_from"]) != (steps, decay_from)
        if state["next_step"] > min(decay_from, state["decay_from"]) and schedule_changed:
            raise SystemExit(f"{state_path} is past the start of its decay (step {state['decay_from']}): "
                             f"resume it with --steps {state['steps']} --decay-from {state['decay_from']}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["rng"])
        generator.set_state(state["generator"])
        first_step, running, elapsed_before = state["next_step"], state["running"], state["elapsed_s"]
        print(f"resuming at step {first_step} from {state_path}", flush=True)
    started = time.time() - elapsed_before
    last_step = steps if stop_after is None else min(steps, stop_after)
    if first_step:  # drop what the interrupted run logged after its last saved state
        kept = [line for line in log_path.read_text().splitlines() if json.loads(line)["step"] < first_step]
        log_path.write_text("".join(line + "\n" for line in kept))
    with log_path.open("a") as log:
        for step in range(first_step, last_step):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            batch = make_batch(rng, batch_size, ar_rows)
            self_condition = rng.random() < 0.5
            parts = losses(model, batch, generator, self_condition, ar_weight)
            optimizer.zero_grad(set_to_none=True)
            parts["total"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            for key, value in parts.items():
                value = float(value.detach())
                running[key] = 0.98 * running.get(key, value) + 0.02 * value
            if step % log_every == 0 or step == steps - 1:
                record = {"step": step, "lr": lr_at(step), "elapsed_s": round(time.time() - started, 1),
                          **{k: round(v, 4) for k, v in sorted(running.items())}}
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
            if save_every and (step + 1) % save_every == 0:
                torch.save(dict(run=run, steps=steps, decay_from=decay_from, next_step=step + 1,
                                model=model.state_dict(), optimizer=optimizer.state_dict(), rng=rng.getstate(),
                                generator=generator.get_state(), running=running,
                                elapsed_s=time.time() - started), state_path.with_suffix(".tmp"))
                state_path.with_suffix(".tmp").replace(state_path)  # never a half-written state
                save_hf_checkpoint(model, out_dir)  # an intermediate checkpoint to evaluate while training goes on
                model.train()
    save_hf_checkpoint(model, out_dir)
    return out_dir


def save_hf_checkpoint(model, out_dir: Path) -> None:
    """Save weights, config and the dg-tiny tokenizer in the form dg convert reads."""
    model.eval()
    try:
        from dgcli.testing.reference import save_checkpoint  # the converter's own writer, when present
    except ImportError:
        save_checkpoint = None
    if save_checkpoint is not None:
        save_checkpoint(model, out_dir)
    else:
        model.save_pretrained(out_dir)
        tiny_vocab().save_hf(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("build/demo-hf"))
    parser.add_argument("--steps", type=int, default=3200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ar-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--stop-after", type=int, help="stop after this many steps of the --steps schedule")
    parser.add_argument("--ar-fraction", type=float, default=0.25, help="share of each batch that also trains AR")
    parser.add_argument("--decay-fraction", type=float, default=0.2, help="share of the steps spent decaying the rate")
    parser.add_argument("--decay-from", type=int,
                        help="step where the decay starts (instead of --decay-fraction); lets a resumed run end sooner")
    parser.add_argument("--init-gguf", type=Path,
                        help="start from this F32 diffusion GGUF's weights (a fine-tune of a shipped demo)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="linear warm-up of the learning rate")
    args = parser.parse_args(argv)
    if args.init_gguf is not None and not args.init_gguf.is_file():
        parser.error(f"--init-gguf {args.init_gguf}: no such file")
    try:
        train(args.out, args.steps, args.batch_size, args.lr, args.ar_weight, args.seed, args.threads,
              args.hidden_size, args.log_every, args.save_every, args.stop_after, args.ar_fraction,
              args.decay_fraction, args.decay_from, args.init_gguf, args.warmup_steps)
    except DgError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
