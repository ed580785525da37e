"""host_math's plain-int launch arithmetic gives triton.cdiv's and triton.next_power_of_2's values
(the launch code calls ours: Triton's are constexpr functions, slow from the host)."""
import triton

from pagedserve.host_math import cdiv, next_power_of_2


def test_next_power_of_2_is_tritons_from_minus_8_to_2_pow_17():
    for n in range(-8, (1 << 17) + 2):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for e in range(17, 40):  # around each larger power of two
        for n in ((1 << e) - 1, 1 << e, (1 << e) + 1):
            assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_is_tritons():
    for a in range(-64, 4097):
        for b in (1, 2, 3, 7, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
