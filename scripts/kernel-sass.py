#!/usr/bin/env python3
"""What ptxas makes of generated kernels, without a GPU: registers, spills and the SASS opcode mix.

Usage: scripts/kernel-sass.py SOURCE [--kernel REGEX] [--arch sm_90] [--top N] [--dump FILE]
       scripts/kernel-sass.py SOURCE --waves LAUNCHES [--sms 132]

SOURCE is a bundle directory (its kernels/model.cu) or a .cu file in the generated layout (the
shared templates, then one `extern "C" __global__` line a kernel, as codegen_cuda emits; `engc
cuda-check --model M.yaml --config C.json --emit FILE` writes one for a model shape without a
checkpoint). The
kernels whose names match REGEX (default: all) are compiled with NVRTC to a cubin for ARCH, as
the runtime compiles them (`-std=c++17`, one program); ptxas's verbose report gives registers,
spills and shared memory a kernel. Where `nvdisasm` can be had (PyPI's nvidia-cuda-nvdisasm,
installed into the venv of scripts/pyenv.sh on first use; its 13.x release reads sm_90 cubins),
each kernel's static instruction count and most common opcodes follow: what docs/perf.md's
instruction counts of the decode GEMVs (2026-11-27) were measured with. --dump FILE writes the
whole SASS (nvdisasm's text) of the matched kernels, to read a loop's body or count it.

--waves FILE reads the launches of a step (`engc cuda-check ... --launches T --launches-to FILE`:
kernel, blocks, threads, dynamic shared memory) and prints, launch by launch, the blocks an SM
of an H100 / H200 holds at once (by registers, shared memory, threads; --sms SMs, default 132)
and the waves the launch takes: a launch of more than one wave cannot have all its blocks
loading before the kernel ahead of it ends (the decode GEMVs' weights, loaded before
`pdl_wait`), and each wave pays its blocks' latency again. `beside`: the share of the launch's
blocks that fit in what the launch before it leaves of the SMs (its first wave spread evenly):
only those start, and load their weights, when the launch before lets it (programmatic launch:
once every block before has started). Where the launch before fits one wave its blocks end
together, so the rest start only after it; where it takes more, its last blocks start as others
end, and more of the launch's blocks start before it ends than the share says. The kernels are
those of FILE.
"""
import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def nvrtc():
    lib = subprocess.run(["bash", os.path.join(HERE, "nvrtc.sh")], check=True, capture_output=True, text=True)
    return ctypes.CDLL(os.path.join(lib.stdout.strip(), "libnvrtc.so"))


def source_of(path, pattern):
    if os.path.isdir(path):
        path = os.path.join(path, "kernels", "model.cu")
    lines = open(path).read().splitlines(keepends=True)
    entry = re.compile(r'^extern "C" __global__ void (?:__launch_bounds__\((?:[^()]|\(\))*\) )?(?:__cluster_dims__\([^)]*\) )?(\w+)\(')
    first = next((i for i, l in enumerate(lines) if entry.match(l)), len(lines))
    kernels = [l for l in lines[first:] if (m := entry.match(l)) and re.search(pattern, m.group(1))]
    if not kernels:
        sys.exit(f"no kernel of {path} matches {pattern!r}")
    return "".join(lines[:first] + kernels), len(kernels)


def compile_cubin(lib, src, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"model.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"-std=c++17", f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(f"NVRTC rejected the source:\n{log.value.decode()}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw, log.value.decode()


def ptxas_report(log):
    """{kernel: (registers, bytes spilled, bytes of static shared memory)} from ptxas's verbose log."""
    out, spilled, name = {}, {}, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif (m := re.search(r"Function properties for (\w+)", line)) and m.group(1) != name:
            name = None  # a called function's report (a __noinline__ one), not the kernel's
        elif name and (m := re.search(r"(\d+) bytes spill stores", line)):
            spilled[name] = int(m.group(1))
        elif name and (m := re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)):
            out[name] = (int(m.group(1)), spilled.get(name, 0), int(m.group(2) or 0))
    return out


def nvdisasm():
    py = subprocess.run(["bash", os.path.join(HERE, "pyenv.sh")], check=True, capture_output=True, text=True)
    py = py.stdout.strip()
    find = "import nvidia, os, glob; print(next(iter(glob.glob(os.path.join(nvidia.__path__[0], '*', 'bin', 'nvdisasm'))), ''))"
    for attempt in range(2):
        r = subprocess.run([py, "-c", find], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
        if attempt == 0:
            print("installing nvidia-cuda-nvdisasm into the venv of scripts/pyenv.sh", file=sys.stderr)
            subprocess.run([py, "-m", "pip", "install", "--quiet", "nvidia-cuda-nvdisasm"], check=False)
    return None


def disassemble(tool, cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout


def opcode_mix(sass):
    mix, name = collections.defaultdict(collections.Counter), None
    for line in sass.splitlines():
        if m := re.match(r"^\.text\.(\w+):", line):
            name = m.group(1)
        elif name and (m := re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)):
            mix[name][m.group(1)] += 1
    return mix


# An sm_90 SM: its register file, the most warps and blocks it holds, its shared memory and
# what the driver keeps of it a block (the CUDA occupancy rules of compute capability 9.0).
SM_REGS, SM_WARPS, SM_BLOCKS, SM_SMEM, BLOCK_SMEM_RESERVED = 65536, 64, 32, 233472, 1024


SM_FREE = (SM_REGS, SM_SMEM, SM_WARPS, SM_BLOCKS)


def block_cost(regs, smem, threads):
    """What one block of `threads` threads, `regs` registers a thread and `smem` bytes of shared
    memory (static and dynamic) takes of an sm_90 SM, in SM_FREE's order: registers, shared
    memory, warps, block slots."""
    warps = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // 256) * 256  # registers are given a warp 256 at a time
    return per_warp * warps, smem + BLOCK_SMEM_RESERVED, warps, 1


def blocks_fit(cost, free=SM_FREE):
    """Blocks of `cost` (block_cost) that fit in what an SM has `free` (SM_FREE's order)."""
    return max(0, min(f // c for f, c in zip(free, cost)))


def beside(prev, prev_blocks, cost, blocks, sms):
    """Blocks of a launch (`cost`, `blocks`) that fit beside the first wave of the launch before
    it (`prev`, `prev_blocks`, spread evenly over `sms` SMs): those that can start, and load
    what they load before `pdl_wait`, while the launch before runs."""
    per = blocks_fit(prev)
    held = min(prev_blocks, per * sms)
    total = 0
    for sm in range(sms):
        n = held // sms + (sm < held % sms)
        total += blocks_fit(cost, [f - n * c for f, c in zip(SM_FREE, prev)])
    return min(blocks, total)


def read_launches(path):
    """[(kernel, blocks, threads, dynamic smem, idle)] of an `engc cuda-check --launches` file."""
    rows = []
    for n, line in enumerate(open(path), 1):
        f = line.rstrip("\n").split("\t")
        if len(f) < 4:
            sys.exit(f"{path}:{n}: expected kernel, blocks, threads, shared memory (tab separated)")
        rows.append((f[0], int(f[1]), int(f[2]), int(f[3]), len(f) > 4 and f[4] == "idle"))
    return rows


def waves_table(launches, report, sms):
    """Per launch: its blocks, the blocks an SM holds, the waves that makes, and the share of
    its blocks that fit beside the launch before it (`beside`)."""
    print(f"{'kernel':<60} {'blocks':>7} {'thr':>4} {'regs':>4} {'smem':>7} {'/SM':>4} {'waves':>6} {'beside':>7}")
    prev = None
    for name, blocks, threads, dyn, idle in launches:
        if name not in report:
            print(f"{name[:60]:<60} {blocks:>7} (no ptxas report)")
            prev = None
            continue
        regs, _, smem = report[name]
        smem += dyn
        cost = block_cost(regs, smem, threads)
        per = blocks_fit(cost)
        waves = f"{blocks / (per * sms):.2f}" if per else "none"
        early = f"{beside(*prev, cost, blocks, sms) / blocks:.2f}" if prev and blocks else "-"
        print(f"{name[:60]:<60} {blocks:>7} {threads:>4} {regs:>4} {smem:>7} {per:>4} {waves:>6} {early:>7}"
              f"{' idle' if idle else ''}")
        prev = (cost, blocks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("--kernel", default=".", help="a regex over kernel names")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--top", type=int, default=8, help="opcodes shown a kernel")
    ap.add_argument("--dump", help="write the whole SASS of the matched kernels to this file")
    ap.add_argument("--waves", help="a step's launches (engc cuda-check --launches-to): their waves")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (--waves)")
    a = ap.parse_args()
    launches = read_launches(a.waves) if a.waves else None
    if launches:
        a.kernel = "^(" + "|".join(sorted({re.escape(l[0]) for l in launches})) + ")$"
    src, n = source_of(a.source, a.kernel)
    print(f"{n} kernels, {a.arch}", file=sys.stderr)
    cubin, log = compile_cubin(nvrtc(), src, a.arch)
    report = ptxas_report(log)
    if launches:
        waves_table(launches, report, a.sms)
        return
    tool = nvdisasm()
    sass = disassemble(tool, cubin) if tool else ""
    mix = opcode_mix(sass)
    if a.dump and sass:
        with open(a.dump, "w") as f:
            f.write(sass)
    for name in sorted(report):
        regs, spilled, smem = report[name]
        print(f"{name}: {regs} registers, {spilled} bytes spilled, {smem} bytes smem")
        if name in mix:
            ops = mix[name]
            top = ", ".join(f"{op} {c}" for op, c in ops.most_common(a.top))
            print(f"  {sum(ops.values())} instructions: {top}")
    if not tool:
        print("(no nvdisasm: registers only)", file=sys.stderr)


if __name__ == "__main__":
    main()
