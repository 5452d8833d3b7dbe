"""Print, for every kernel in Triton's cache: shared memory, stages, warps, registers (ptxas -v), cp.async / ld.global counts."""
import glob, json, os, re, subprocess, sys
import triton
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
names = sys.argv[1].split(",")
for meta in glob.glob(os.path.expanduser("~/.triton/cache/*/*.json")):
    base = os.path.basename(meta)[:-5]
    if base not in names:
        continue
    md = json.load(open(meta))
    ptx_path = meta[:-5] + ".ptx"
    if not os.path.exists(ptx_path):
        continue
    ptx = open(ptx_path).read()
    out = subprocess.run([ptxas, f"-arch=sm_{md['target']['arch']}a", "-v", ptx_path, "-o", "/dev/null"], capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    spill = re.findall(r"(\d+) bytes spill stores", out)
    cons = {k: v for k, v in md.get("constants", {}).items()} if isinstance(md.get("constants"), dict) else {}
    print(base, "warps", md.get("num_warps"), "stages", md.get("num_stages"), "shared", md.get("shared"), "regs", regs, "spill", spill,
          "cp.async", len(re.findall(r"cp\.async\.c", ptx)), "bulk", len(re.findall(r"cp\.async\.bulk", ptx)),
          "ld.global", len(re.findall(r"ld\.global", ptx)), "wgmma", len(re.findall(r"wgmma\.mma_async", ptx)),
          "mma.sync", len(re.findall(r"mma\.sync", ptx)))
