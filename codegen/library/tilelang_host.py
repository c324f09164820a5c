"""The host side of the TileLang templates on a GPU: allocate an op's outputs, bind the kernel's
buffers by parameter name, launch (the runtime's `launch(i, **buffers)` runs the instance's i-th
cubin). Kept out of the template modules: those are hashed into the render cache key, and the
host side does not change what a template renders."""
import torch

from ...ir import dtypes as dt


def _torch_dtype(name):
    return dt.dtype(name).storage


def _pad_rows(t, rows: int):
    """`t` with zero rows appended up to `rows` (the instance's row count; see canonical_rows)."""
    if t.shape[0] == rows:
        return t
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def _run_2d(launch, config, m, rows, n, out_dtype, **buffers):
    """C[:m] of the kernel over 2-D operands padded to its `rows`; split-K kernels accumulate
    atomically into zeroed fp32."""
    dev = next(iter(buffers.values())).device
    if config.get("split_k", 1) > 1:
        c = torch.zeros(rows, n, dtype=torch.float32, device=dev)
        launch(0, C=c, **buffers)
        return c[:m].to(out_dtype)
    c = torch.empty(rows, n, dtype=out_dtype, device=dev)
    launch(0, C=c, **buffers)
    return c[:m]


def host_gemm_fp8(launch, inputs, attrs, config, meta):
    x, w = inputs
    k, n = x.data.shape[-1], w.data.shape[0]
    a = x.data.reshape(-1, k).contiguous()
    if meta.get("rows_argument"):  # the kernel reads the live rows: no padding, no zeroing
        m, dev = a.shape[0], a.device
        sa = x.scale.reshape(-1, k // 32).contiguous()
        c = torch.empty(m, n, dtype=_torch_dtype(attrs["out_dtype"]), device=dev)
        if config.get("split_k", 1) > 1:
            p = torch.empty(config["split_k"], meta["mnk"][0], n, dtype=torch.float32, device=dev)
            launch(0, A=a, SA=sa, B=w.data, SB=w.scale, C=p, m=m)
            launch(1, P=p, C=c, m=m)
        else:
            launch(0, A=a, SA=sa, B=w.data, SB=w.scale, C=c, m=m)
        return c.reshape(*x.data.shape[:-1], n)
    m, rows = a.shape[0], max(meta["mnk"][0], a.shape[0])
    c = _run_2d(launch, config, m, rows, n, _torch_dtype(attrs["out_dtype"]), A=_pad_rows(a, rows),
                SA=_pad_rows(x.scale.reshape(-1, k // 32).contiguous(), rows), B=w.data, SB=w.scale)
    return c.reshape(*x.data.shape[:-1], n)


def host_linear(launch, inputs, attrs, config, meta):
    x, w = inputs
    k, n = x.shape[-1], w.shape[0]
    a = x.reshape(-1, k).contiguous()
    m, rows = a.shape[0], max(meta["mnk"][0], a.shape[0])
    out = _torch_dtype(attrs["out_dtype"]) if attrs.get("out_dtype") else x.dtype
    return _run_2d(launch, config, m, rows, n, out, A=_pad_rows(a, rows), B=w.contiguous()).reshape(*x.shape[:-1], n)


def host_gemm_fp8_rows_bf16(launch, inputs, attrs, config, meta):
    """gemm_fp8 on bf16 MMAs (tilelang_prefill_bf16): the second kernel dequantises the rows into
    bf16 first, then the GEMM reads them with the fp8 weight."""
    x, w = inputs
    k, n = x.data.shape[-1], w.data.shape[0]
    a8 = x.data.reshape(-1, k).contiguous()
    m, rows = a8.shape[0], max(meta["dims"]["rows"], a8.shape[0])
    a = torch.empty(rows, k, dtype=torch.bfloat16, device=a8.device)
    launch(1, A8=_pad_rows(a8, rows), SA=_pad_rows(x.scale.reshape(-1, k // 32).contiguous(), rows), A=a)
    c = torch.empty(rows, n, dtype=_torch_dtype(attrs["out_dtype"]), device=a8.device)
    launch(0, X=a, W=w.data, SW=w.scale, C=c)
    return c[:m].reshape(*x.data.shape[:-1], n)


def host_grouped_linear(launch, inputs, attrs, config, meta):
    x, w = inputs
    k, n = x.shape[-1], w.data.shape[0]
    a = x.reshape(-1, k).contiguous()
    m, rows = a.shape[0], max(meta["dims"]["rows"], a.shape[0])
    c = _run_2d(launch, config, m, rows, n, x.dtype, X=_pad_rows(a, rows), W=w.data, SW=w.scale)
    return c.reshape(*x.shape[:-1], n)


def host_grouped_gemm_fp4(launch, inputs, attrs, config, meta):
    x, w, offsets = inputs
    m, rows = x.data.shape[0], max(meta["dims"]["rows"], x.data.shape[0])
    # rows past the last expert's range are not computed by the kernel; the op leaves them 0
    c = torch.zeros(rows, w.data.shape[1], dtype=torch.bfloat16, device=x.data.device)
    launch(0, X=_pad_rows(x.data, rows), SX=_pad_rows(x.scale, rows), W=w.data, SW=w.scale, offsets=offsets, C=c)
    return c[:m]


def host_indexer_scores(launch, inputs, attrs, config, meta):
    qi, w, ik, pos, tseq, bt = inputs
    s = torch.empty(qi.data.shape[0], bt.shape[1] * ik.data.shape[1], dtype=torch.float32, device=w.device)
    # CAND: the candidate pool is a separate op here (this template renders without it)
    launch(0, QI=qi.data, QS=qi.scale, W=w, IK=ik.data, IKS=ik.scale, POS=pos, TSEQ=tseq, BT=bt,
           CAND=_placeholder((qi.data.shape[0], 1), torch.int32, w.device), S=s)
    return s


def host_attention(launch, inputs, attrs, config, meta):
    """Inputs in the op's order; window and DSpark calls bind 1-element placeholders for the
    compressed-cache buffers their kernels declare but never read."""
    if len(inputs) == 10:
        q, kv, ring, ckv, top, sink, pos, tseq, slots, bt = inputs
        ckv_d, ckv_s = ckv.data, ckv.scale
    else:
        q, kv, ring, sink, pos, tseq, slots = inputs
        d = q.shape[-1]
        ckv_d = _placeholder((1, 1, d // 2), torch.uint8, q.device)
        ckv_s = _placeholder((1, 1, d // 16), torch.uint8, q.device)
        top = _placeholder((q.shape[0], 1), torch.int32, q.device)
        bt = _placeholder((slots.shape[0], 1), torch.int32, q.device)
    n, h, d = q.shape
    sp = config["splits"]
    o = torch.empty(n, h, d, dtype=torch.bfloat16, device=q.device)
    op = torch.empty((sp, n, h, d) if sp > 1 else (1, 1, 1, 1), dtype=torch.float32, device=q.device)
    ml = torch.empty((sp, n, h, 2) if sp > 1 else (1, 1, 1, 2), dtype=torch.float32, device=q.device)
    freq = rope_frequencies(attrs, q.device)
    launch(0, Q=q.contiguous(), KV=kv.data, KVS=kv.scale, RING=ring.data, RINGS=ring.scale, CKV=ckv_d, CKVS=ckv_s,
           TOP=top, SINK=sink, POS=pos, TSEQ=tseq, SLOTS=slots, BT=bt, O=o, OP=op, ML=ml, FREQ=freq)
    if sp > 1:
        launch(1, OP=op, ML=ml, SINK=sink, O=o, POS=pos, FREQ=freq)
    return o


def _placeholder(shape, dtype, device) -> torch.Tensor:
    """Zeros for a buffer the kernel declares but never reads, made on the host and copied: a
    constant of the recipe, placed once at load, not a fill launched every call."""
    with torch.device("cpu"):
        return torch.zeros(shape, dtype=dtype).to(device)


def rope_frequencies(attrs, device) -> torch.Tensor:
    """The RoPE frequencies of an attention call with its rotations folded in (rope_dim > 0:
    fuse_attention_rope), a constant of the recipe; a 1-element placeholder otherwise."""
    if not attrs.get("rope_dim"):
        return _placeholder((1,), torch.float32, device)
    from ...ir.ops.attention import yarn_freqs

    yarn = attrs.get("rope_yarn")
    with torch.device("cpu"):  # real values (a constant of the recipe), whatever device context the host runs under
        freq = yarn_freqs(attrs["rope_dim"], attrs["rope_theta"], tuple(yarn) if yarn else None)
    return freq.to(device)
