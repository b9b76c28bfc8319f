"""`meshlm generate`: sample text from a checkpoint in one process.

The model is rebuilt from the run's ``config.json`` saved beside the checkpoint, at TP=1 / PP=1,
and its weights are assembled from every rank of the checkpoint (``checkpoint.state.
full_model_state``): checkpoints written at any TP/PP layout load, because each TP shard was
saved with the rows/columns of the full weight it holds and pipeline stages hold disjoint
global layer names. Decoding re-runs the model on the whole context for each new
token — no KV cache: a tool for looking at a small model's output, not a serving engine.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch

from ..checkpoint import dist as ckpt
from ..checkpoint.safe_read import reading
from ..checkpoint.state import changed_tokenizer, full_model_state
from ..config import Config, max_positions
from ..data.tokenizer import NullTokenizer, build_tokenizer
from ..errors import CheckpointError, ConfigError, DataError
from ..parallel.mesh import ParallelState
from ..parallel.tensor import load_full_state_dict

DEFAULT_PROMPT = "def "
DEFAULT_NEW_TOKENS = 64  # --max-new-tokens when not given, cut to the room the model's context leaves


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `meshlm generate`."""
    parser.add_argument("--load", required=True, help="checkpoint directory (--save of a run, or one iter_XXXXXXX)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens to generate (default {DEFAULT_NEW_TOKENS}, or fewer when the model's "
                             f"context has less room after the prompt)")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed")


def check_sampling_flags(args: argparse.Namespace) -> None:
    """ConfigError listing every numeric flag of `meshlm generate` that is out of range (one line each)."""
    problems = []
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        problems.append(f"--max-new-tokens {args.max_new_tokens} is negative; use 0 or more")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        problems.append(f"--temperature {args.temperature}: use a finite number ≥ 0 (0 = greedy)")
    if args.top_k < 0:
        problems.append(f"--top-k {args.top_k} is negative; use 0 (all tokens) or more")
    if not 0 < args.top_p <= 1:  # false for nan too
        problems.append(f"--top-p {args.top_p}: use a number in (0, 1] (1 = off)")
    if not 0 <= args.seed < 2**64:
        problems.append(f"--seed {args.seed} is out of range; use 0 ≤ seed < 2^64")
    if problems:
        raise ConfigError(problems)


def check_prompt(tokenizer, prompt: str) -> None:
    """ConfigError naming --prompt when this checkpoint's tokenizer cannot encode it (text that is
    not valid Unicode; for a NullTokenizer, anything but token ids in [0, vocab))."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"--prompt {prompt!r} is not valid UTF-8 text; give the prompt as text") from None
    if not isinstance(tokenizer, NullTokenizer):
        return
    try:
        tokenizer.encode(prompt)
    except ValueError as e:  # not an id, or one outside the vocabulary
        default = " (the default)" if prompt == DEFAULT_PROMPT else ""
        raise ConfigError(f"--prompt {prompt!r}{default}: {e}; this checkpoint's NullTokenizer takes "
                          f"whitespace-separated token ids in [0, {tokenizer.vocab_size}), "
                          f"e.g. --prompt \"0 1 2\"") from None


def run(args: argparse.Namespace) -> int:
    """Load --load, continue --prompt, print prompt + continuation; return the exit status 0."""
    check_sampling_flags(args)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, tokenizer = load_model(args.load, device=device)
    check_prompt(tokenizer, args.prompt)
    new_tokens = args.max_new_tokens
    if new_tokens is None:  # the default fits any model: a short context is not an error the user caused
        new_tokens = max(0, min(DEFAULT_NEW_TOKENS, model.max_context - len(prompt_ids(tokenizer, args.prompt))))
    text = sample_text(model, tokenizer, args.prompt, max_new_tokens=new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(args.prompt + text)
    return 0


def prompt_ids(tokenizer, prompt: str) -> list:
    """The token ids decoding starts from: the prompt's, or end-of-document alone for an empty prompt."""
    return tokenizer.encode(prompt) or [tokenizer.eod]


def check_length(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """ConfigError when the prompt and --max-new-tokens do not fit the model's context
    (``model.max_context``, set by load_model), as Megatron's text generation refuses prompt +
    tokens to generate > --max-position-embeddings: a learned-position model has no position
    beyond it, a RoPE model was never trained past its --seq-length."""
    context, flag = model.max_context, model.max_context_flag
    if prompt_tokens > context:
        raise ConfigError(f"--prompt is {prompt_tokens} tokens, more than this model's context of {context} "
                          f"({flag}); give a prompt of at most {context} tokens")
    if prompt_tokens + max_new_tokens > context:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} and the prompt's {prompt_tokens} "
                          f"token{'s' if prompt_tokens != 1 else ''} exceed this "
                          f"model's context of {context} ({flag}); use --max-new-tokens "
                          f"{context - prompt_tokens} or less")


def load_model(path: str, device: Optional[torch.device] = None) -> tuple:
    """(GPTModel at TP=1/PP=1 in eval mode, fp32 on ``device``; its tokenizer) from a checkpoint.

    path: a --save directory (the tracker's iteration is used) or one iter_XXXXXXX folder.
    Raises CheckpointError when the folder, its config.json, the tokenizer file it names or a weight
    is missing, and one line (checkpoint.safe_read.damaged) when any of its files cannot be read.
    """
    from ..model.transformer import GPTModel

    folder = path if os.path.isfile(os.path.join(path, ckpt.MANIFEST)) else ckpt.checkpoint_dir(path)
    with reading(folder, load=path):
        saved = ckpt.read_config(folder)
    cfg = Config.from_dict(saved)
    try:
        tokenizer = build_tokenizer(cfg.data, cfg.model.vocab_size)
    except (ConfigError, DataError) as e:  # its flags are the run's, not generate's (which has none)
        raise CheckpointError(f"--load {path}: the tokenizer the run trained with does not load ({e}); the "
                              f"checkpoint names it by the run's path: put the file back there") from None
    full = full_model_state(folder, load=path)
    changed = changed_tokenizer(cfg.data, tokenizer.vocab_size, full["embedding.word_embeddings.weight"].shape[0])
    if changed:
        raise CheckpointError(f"--load {path}: {changed}")
    device = device or torch.device("cpu")
    model = GPTModel(cfg.model, ParallelState.single(device), tokenizer.vocab_size, seed=cfg.training.seed)
    try:
        load_full_state_dict(model, full)
    except KeyError as e:
        raise CheckpointError(f"checkpoint {folder} has no weight {e}: was it saved from this model?") from None
    model.eval()
    m = cfg.model
    model.max_context = max_positions(m) if m.position_embedding_type != "rope" else m.seq_length
    model.max_context_flag = "its --seq-length, under RoPE" if m.position_embedding_type == "rope" else \
        "its --max-position-embeddings" if m.max_position_embeddings else "its --seq-length, which sized its positions"
    return model, tokenizer


@torch.no_grad()
def sample_text(model, tokenizer, prompt: str, *, max_new_tokens: int = 64, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None) -> str:
    """Continue ``prompt`` with up to max_new_tokens tokens (stops at end-of-document); return the
    continuation only (the text that follows the decoded prompt, so ``prompt + result`` reads on). temperature 0 is greedy; top_k / top_p filter before sampling (Holtzman
    et al. 2020 for nucleus sampling). The prompt and the new tokens must fit ``model.max_context``
    (check_length; ConfigError otherwise).
    """
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, prompt)
    check_length(model, len(ids), max_new_tokens)
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    new = []
    for _ in range(max_new_tokens):
        x = torch.tensor([ids + new], dtype=torch.long, device=device)
        logits = model(x)[0, -1, :tokenizer.vocab_size].float()  # [V], padding dropped
        nxt = int(logits.argmax()) if temperature == 0 else \
            _sample((logits.double() - logits.max()) / temperature, top_k, top_p, gen)  # 1e-300 gave nan
        if nxt == tokenizer.eod:
            break
        new.append(nxt)
    given = tokenizer.encode(prompt)
    return tokenizer.decode(given + new)[len(tokenizer.decode(given)):]


def _sample(logits: torch.Tensor, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """Draw one id from softmax(logits) restricted to the top-k ids and the top-p probability mass."""
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= top_p  # keep the smallest prefix reaching top_p
        drop[0] = False  # the likeliest id stays: a top_p below float32's least (1e-300) is 0 there
        probs = probs.clone()
        probs[order[drop]] = 0.0
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))
