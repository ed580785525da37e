"""Build a Triton kernel ahead of time for the H200 (sm_90) with Triton's bundled ptxas, on a
machine without a GPU: the interpreter checks a kernel's arithmetic, this its compiler's rules."""
import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


# The H200's (and H100's) largest shared memory a block may ask for.
SM90_MAX_SHARED = 232448


def compile_sm90(fn, const: dict, pointers: dict, num_warps: int = 4, num_stages: int = 3,
                 aligned: bool = False) -> str:
    """The PTX of fn with `const` as its constexprs (a pointer given None is one too), every other
    argument typed by `pointers` (name -> Triton type) or else i32; with `aligned`, every pointer
    16-byte aligned, as a launch with fresh tensors specializes them. Skips where this Triton has no ptxas."""
    return compile_sm90_kernel(fn, const, pointers, num_warps, num_stages, aligned).asm["ptx"]


def compile_sm90_kernel(fn, const: dict, pointers: dict, num_warps: int = 4, num_stages: int = 3,
                        aligned: bool = False):
    """compile_sm90's compiled kernel itself (its metadata: .shared, the bytes of shared memory)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if aligned and t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as e:  # no ptxas in this Triton build: nothing to check offline
        if "ptxas" in str(e):
            pytest.skip(str(e))
        raise
