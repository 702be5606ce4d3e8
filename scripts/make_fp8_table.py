#!/usr/bin/env python3
"""Writes the fp8 conversion table that tests/test_fp8.cpp holds kernels/element.h to: for each of the 65,536 bf16 bit
patterns in order, PyTorch's float8_e4m3fn code and then its float8_e5m2 code of that value clamped to the format's
largest finite value (448, 57344), so that the table is the saturating conversion; PyTorch's plain cast gives NaN
(e4m3fn) or infinity (e5m2) beyond it. NaN stays NaN. Needs PyTorch 2.1 or newer (the GPU machine has it; Debian's
1.13 has no float8 types).

    python3 scripts/make_fp8_table.py -o tests/fixtures/fp8_bf16_table.bin [--device cuda]
"""
import argparse
import hashlib
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", required=True, help="the table file to write (131,072 bytes)")
    ap.add_argument("--device", default="cuda", help="where the conversions run (cuda, or cpu)")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("make_fp8_table.py: PyTorch is not installed")
    if not hasattr(torch, "float8_e4m3fn"):
        sys.exit(f"make_fp8_table.py: PyTorch {torch.__version__} has no float8 types (2.1 or newer has them)")
    device = a.device if a.device != "cuda" or torch.cuda.is_available() else "cpu"
    bits = torch.arange(65536, dtype=torch.int32, device=device)
    bits = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16)
    values = bits.view(torch.bfloat16).float()
    codes = []
    for dtype, largest in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        codes.append(values.clamp(-largest, largest).to(dtype).view(torch.uint8))
    table = torch.stack(codes, dim=1).reshape(-1).cpu().numpy().tobytes()
    assert len(table) == 2 * 65536
    with open(a.out, "wb") as f:
        f.write(table)
    print(f"wrote {a.out}: {len(table)} bytes, sha256 {hashlib.sha256(table).hexdigest()}, PyTorch {torch.__version__} "
          f"on {device}")


if __name__ == "__main__":
    main()
