"""Packed sequences, a lever of the trainer measured here before train.py takes it: a drop-in
`token_logprobs` with train.token_logprobs' contract (the same batch in, the same (B, T-1) logprobs
out) that runs the model on the batch's sequences packed into one row, without padding, each
attending within itself (varlen_attention). bench/trainer_step.py --pack times it beside the padded
forward; bench/trl_gpu.py's "packed" variants train with it (`patched`).

    with packing.patched():   # train.token_logprobs is this module's until the block ends
        train.train(cfg, client)
"""

import inspect
import itertools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import train


def varlen_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface over sequences packed into one row: each attends within
    itself, causally, by kwargs' cu_seq_lens_q. On a GPU torch's varlen_attn (FlashAttention's
    variable-length kernel, forward and backward); on a CPU sdpa per sequence. A call of the model
    without them (train.check_logprobs') attends by sdpa, with its mask."""
    if "cu_seq_lens_q" not in kwargs:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    groups = query.shape[1] // key.shape[1]
    # (1, heads, T, D) -> (T, heads, D), the KV heads repeated for their query heads
    q = query[0].transpose(0, 1)
    k = key[0].repeat_interleave(groups, 0).transpose(0, 1)
    v = value[0].repeat_interleave(groups, 0).transpose(0, 1)
    # FlashAttention takes 16-bit floats: a float32 forward without autocast (train.check_logprobs'
    # probe) attends by sdpa per sequence, as on a CPU
    flash = q.is_cuda and (torch.is_autocast_enabled("cuda") or q.dtype != torch.float32)
    if not flash:
        bounds = cu.tolist()
        outs = [
            F.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scaling
            ).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])
        ]
        return torch.cat(outs)[None], None
    from torch.nn.attention.varlen import varlen_attn

    # the rotary embedding leaves q and k in float32 under autocast; the kernel takes bf16
    if torch.is_autocast_enabled("cuda"):
        q, k, v = (x.to(torch.get_autocast_dtype("cuda")) for x in (q, k, v))
    # torch 2.10 and 2.11 take is_causal (and the default scale), later releases window_size
    if "is_causal" in inspect.signature(varlen_attn).parameters:
        assert scaling == q.shape[-1] ** -0.5, "varlen_attn scales by 1/sqrt(head_dim) only"
        out = varlen_attn(q, k, v, cu, cu, longest, longest, is_causal=True)
    else:
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0))
    return out[None], None


# while token_logprobs runs its packed forward: no mask to build (the sequences' bounds are it)
PACKED = {"now": False}


def varlen_mask(*args, **kwargs):
    """No mask for the packed forward; sdpa's for any other call of the model."""
    return None if PACKED["now"] else ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


AttentionInterface.register("varlen", varlen_attention)
AttentionMaskInterface.register("varlen", varlen_mask)


def token_logprobs(model, batch, temperature=1.0, chunk_tokens=2048):
    """train.token_logprobs' (B, T-1) logprobs of a right-padded batch, computed on its sequences
    packed into one row (position ids restart at each). The model attends by varlen_attention from
    here on, backward's recomputation included: `patched` and trainer_step set it back."""
    if model.config._attn_implementation != "varlen":
        model.set_attn_implementation("varlen")
    device = model.device
    ids, attention = batch["input_ids"], batch["attention"].bool()
    lengths = attention.sum(1).tolist()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    row = ids[attention].to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    PACKED["now"] = True
    try:
        hidden = model(
            input_ids=row[None],
            position_ids=positions[None],
            logits_to_keep=1,
            output_hidden_states=True,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        ).hidden_states[-1][0]
    finally:
        PACKED["now"] = False
    # padded position t of sequence i (it predicts token t + 1) is packed position cu[i] + t
    keep = batch["mask"].to(device).flatten() > 0
    packed_at = (cu[:-1, None] + torch.arange(ids.shape[1] - 1, device=device)).flatten()[keep]
    out = train.output_logprobs(
        model, hidden[packed_at], row[packed_at + 1], temperature, chunk_tokens
    )
    logprobs = torch.zeros(keep.shape, device=device).masked_scatter(keep, out)
    return logprobs.view(len(ids), -1).cpu()


@contextmanager
def patched(model=None):
    """train.token_logprobs is this module's inside the block; on the way out train.py's own is
    back, and `model` (if given) attends by sdpa again."""
    own = train.token_logprobs
    train.token_logprobs = token_logprobs
    try:
        yield
    finally:
        train.token_logprobs = own
        if model is not None:
            model.set_attn_implementation("sdpa")
