"""The order in which a GEMM's output tiles are handed to programs, shared by our Triton GEMMs
(layers/fused_moe/triton_moe.py, layers/quant/triton_fp8_gemm.py)."""
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid` in grouped order: GROUP_M row blocks run
    against each column block in turn, so a weight tile is read from L2 by GROUP_M programs
    in a row instead of once from HBM by each (GROUP_M 1: row blocks fastest)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size
