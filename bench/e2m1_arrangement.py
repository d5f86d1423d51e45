#!/usr/bin/env python
"""Can a stored arrangement of E2M1 bits make the frag decode one shift and one mask per register?

    python bench/e2m1_arrangement.py          # no GPU, a few seconds

The frag decode (docs/KERNELS.md "Decode by shifts") builds each bf16x2 operand register with
a nibble's magnitude at bits 6..8 and its sign at bit 15 of each half: the register's bits are
S = {6, 7, 8, 15, 22, 23, 24, 31}. If some stored arrangement let every register be
``(window >> s) & mask`` of the loaded bits, translates of S would tile the loaded bits. This
searches every offset for exact covers of 32, 64, 128 and 256 contiguous bits (windows that
cross a 32-bit word are one funnel shift), and prints the integer-instruction counts per 32-bit
word (8 values) of the decode as the kernels do it on DeepGEMM's bytes and of a near tiling
(three registers by one shift + mask, the fourth from three pieces).
"""
from __future__ import annotations

S = (6, 7, 8, 15, 22, 23, 24, 31)


def exact_covers(nbits: int, limit: int = 1, shape: tuple = S) -> list[list[int]]:
    """Up to ``limit`` sets of offsets t with {p + t : p in shape} partitioning range(nbits)."""
    offs = [t for t in range(-min(shape), nbits) if all(0 <= p + t < nbits for p in shape)]
    masks = {t: sum(1 << (p + t) for p in shape) for t in offs}
    found: list[list[int]] = []

    def rec(covered: int, chosen: list[int]) -> None:
        if len(found) >= limit:
            return
        if covered == (1 << nbits) - 1:
            found.append(list(chosen))
            return
        low = (~covered & (covered + 1)).bit_length() - 1  # lowest uncovered bit
        for t in offs:
            m = masks[t]
            if m >> low & 1 and not covered & m:
                chosen.append(t)
                rec(covered | m, chosen)
                chosen.pop()

    rec(0, [])
    return found


def kernel_layout_cost() -> int:
    """Integer instructions per word on DeepGEMM's nibble order (the frag decode's SASS): register j
    (nibbles j and j+4) needs its magnitude shifted by 6-4j and its sign by 12-4j (none for j=3),
    then a mask and a masked merge."""
    shifts = sum(1 for j in range(4) if 6 - 4 * j != 0) + sum(1 for j in range(4) if 12 - 4 * j != 0)
    return shifts + 4 + 4


def near_tiling_cost() -> int:
    """Three registers at offsets 0, -3, -6 (one mask, shift + mask, shift + mask) and the fourth
    from the bits left over ({10, 11, 13, 14} + 16), which lie at three different offsets from
    S: three shifts, one mask and two masked merges (3-input LOP3)."""
    left = set(range(32)) - {p - s for s in (0, 3, 6) for p in S}
    assert left == {10, 11, 13, 14, 26, 27, 29, 30}, left
    return 1 + 2 + 2 + (3 + 3)


def main() -> None:
    # the search itself, on shapes that do tile: a 4-bit run, and S's two-halves structure with
    # 4-bit runs instead of the 3 + 1 split of magnitude and sign
    assert exact_covers(32, shape=(0, 1, 2, 3)) == [[0, 4, 8, 12, 16, 20, 24, 28]]
    assert exact_covers(32, shape=(6, 7, 8, 9, 22, 23, 24, 25)) == [[-6, -2, 2, 6]]
    for n in (32, 64, 128, 256):
        covers = exact_covers(n)
        print(f"exact covers of {n:3d} bits by translates of S: {'none' if not covers else covers[0]}")
    print(f"integer instructions per 32-bit word: DeepGEMM's bytes {kernel_layout_cost()}, "
          f"a near tiling (three registers by one shift + mask) {near_tiling_cost()}")


if __name__ == "__main__":
    main()
