"""Placeholder for ``sgl_kernel`` in the CPU server environment (scripts/setup_sglang_env.sh installs it).

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports ``sgl_kernel``, whose CPU build is not published on PyPI (the
PyPI wheels are CUDA builds). On a CPU without AMX SGLang runs the dense model with torch-native layers and calls
one function of this package, ``assign_req_to_token_pool_cpu``, implemented here with torch indexing. Any other name
imports as a function that raises NotImplementedError, so a server path that would need a real kernel stops
with the kernel's name instead of computing something else.

SGLang enables its AMX kernels only when ``torch.ops.sgl_kernel.convert_weight_packed`` exists
(``sglang/srt/utils/common.py``, ``cpu_has_amx_support``); this package registers no torch op, so an AMX
machine takes the same torch-native path. Unnecessary where a CPU build of sgl-kernel can be installed.
"""

__version__ = "0.0.0+placeholder"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's new KV-cache slots into its row of the request-to-token table, in place.

    Args:
        req_pool_indices: int [B], the table row of each request.
        req_to_token: int [num_rows, pool_len], the table (a view of ``pool_len`` columns per row).
        start_offset, end_offset: int [B]; request i gets columns start_offset[i]:end_offset[i].
        out_cache_loc: int [sum(end_offset - start_offset)], the new slots, request after request.
        pool_len: the table's row length (checked against ``req_to_token``).
    Raises:
        ValueError: when the slot count or the row length disagree with the table.
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} != req_to_token row length {req_to_token.shape[1]}")
    lengths = (end_offset - start_offset).tolist()  # B ints
    if sum(lengths) != out_cache_loc.numel():
        raise ValueError(f"{sum(lengths)} slots requested, out_cache_loc holds {out_cache_loc.numel()}")
    read = 0
    for row, start, length in zip(req_pool_indices.tolist(), start_offset.tolist(), lengths):
        req_to_token[row, start : start + length] = out_cache_loc[read : read + length].to(req_to_token.dtype)
        read += length


def __getattr__(name):
    """Any other kernel: a function that raises NotImplementedError when called (SGLang imports several at
    start-up that the dense-model path never calls)."""
    if name.startswith("__"):  # module machinery (__path__, __wrapped__, ...) asks with hasattr
        raise AttributeError(name)

    def missing_kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU server environment: only "
            "assign_req_to_token_pool_cpu is (scripts/sglang_cpu/sgl_kernel)"
        )

    missing_kernel.__name__ = name
    return missing_kernel
