"""The softmax family's launch configs: the lists the tuner picks among for every kernel (one-pass,
online, split), the rules that prune them for a shape bucket, and the untuned default a first call
runs. The kernels are in ``kernels.py`` and ``split_kernels.py``; ``softmax.py`` holds the launches.
"""

from __future__ import annotations

from tritonkit._launch import next_power_of_2
from tritonkit._runtime import current_device, sm_count

# One-pass kernels: each program holds BLOCK_M whole rows; BLOCK_N is the row length rounded up
# to a power of two. A thread holds BLOCK_M * BLOCK_N / (32 * num_warps) fp32 values per tile; past
# ONE_PASS_MAX_PER_THREAD the row no longer fits in registers and ptxas spills.
ONE_PASS_MAX_PER_THREAD = 64
ONE_PASS_MAX_BLOCK_N = 32768  # = 64 values a thread at 16 warps; 32 warps allow only 64 registers
COLS_MIN_BLOCK_M = 16  # rows a program takes when rows are the contiguous axis: 32+ bytes a warp access

# The configs both directions tune over. Each shape bucket is tuned once over every variant ("auto"
# takes the winner; a named variant its own fastest): with rows of 32768 the online kernel won on
# the H200 (pass 2 finds its chunks in L2, and more programs fit an SM).
# Values a thread holds per tile (_per_thread) are kept within these bounds: on the H200 every
# winner fell inside them, and the timing of each extra config costs a compile.
PER_THREAD = {"one-pass": (16, ONE_PASS_MAX_PER_THREAD), "online": (8, 32), "split": (8, 16)}
CONFIGS = (
    [
        {"variant": "one-pass", "BLOCK_M": m, "num_warps": w}
        for m in (1, 2, 4, 8, 16, 32, 64, 128)
        for w in (4, 8, 16, 32)
    ]
    + [
        {"variant": "online", "BLOCK_M": m, "BLOCK_N": n, "num_warps": w}
        for m in (1, 16, 64)
        for n in (16, 64, 2048, 4096, 8192)
        for w in (4, 8, 16)
    ]
    + [
        {"variant": "online", "BLOCK_M": 1, "BLOCK_N": n, "num_warps": w, "PREFETCH": True}
        for n in (2048, 4096, 8192)
        for w in (4, 8, 16)
    ]
    + [
        {"variant": "split", "SEGMENT": segment, "BLOCK_N": n, "num_warps": w, "PER_SM": k}
        for segment in (4096, 8192, 16384)
        for n in (2048, 4096)
        if segment >= 2 * n
        for w in (4, 8)
        for k in (2, 4, 8)
    ]
)

# Persistent one-pass configs (STAGES): as many programs as an SM holds walk the row blocks, and
# Triton's pipeliner copies the next block into shared memory (cp.async) while this one is reduced
# and stored. A one-pass program otherwise has no load in flight from its last load to its store,
# and a long row's program is alone or one of two on its SM (at 16384 entries and up: 64-127
# registers a thread of 16 warps), so nothing hides that gap. The untuned default (which the tuner
# times beside the other candidates) takes it from PERSISTENT_MIN_ENTRIES of the tiles a program
# holds, within STAGED_MAX_SHARED_BYTES of staged blocks (the H200's SM has 227 KB for a program),
# where PERSISTENT_DEFAULT is on. Measured on the H200 at feb8227 (benchmarks/softmax_persistent.py,
# history/softmax-persistent-feb8227.json) it lost wherever the rule took it: 0.32 of the copy rate
# against 0.54 without at 17944 x 9017 bf16 forward, 0.50 against 0.84 backward, 0.73 against 0.79
# at 8192 x 32768: off until the cause is known (the configs stay, for the benchmark and the tests).
PERSISTENT_DEFAULT = False
PERSISTENT_MIN_ENTRIES = 16384
STAGED_MAX_SHARED_BYTES = 192 << 10
# Split-row kernels: PER_SM programs an SM, each holding one SEGMENT of a row between its two
# passes. Two budgets pull apart. What is between the passes must stay in L2 for pass 2 to hit it:
# most of the H200's 50 MB (a row of 4M fp32 entries alone, y and dy, is 32 MB). And an SM needs
# about 32 KB of loads in flight to keep its share of HBM busy (4.8 TB/s over 132 SMs times ~1 us
# of latency), while one program has only a chunk (8 KB at 4096 bf16 entries) in flight: several
# programs an SM, in short segments. PER_SM * num_warps stays within half an SM's 64 warps, which
# the kernels' registers (at most 64 a thread) always allow, so the cooperative launch fits.
# Online configs with short chunks are for the cols layout: along a contiguous row, chunks under a
# quarter of the row or ONLINE_MIN_ROWS_CHUNK entries never won on the H200 (some took 100x the best).
ONLINE_MIN_ROWS_CHUNK = 2048
# PREFETCH online configs hold two chunks at once (the next one's load is issued before this one is
# reduced, so a program keeps loads in flight through its reductions' barriers): rows of two chunks
# or more, at most PREFETCH_MAX_PER_THREAD values a thread a chunk (8192 entries at 16 warps: 61
# registers on sm_90, no spills). Not yet measured on the H200; the tuner decides.
PREFETCH_MAX_PER_THREAD = 16
SPLIT_L2_BYTES = 40 << 20
SPLIT_MAX_WARPS_PER_SM = 32
# The untuned default takes the split kernel for rows too long for registers where the online
# kernel's one program a row leaves the GPU short of loads in flight: few rows (at most
# SPLIT_DEFAULT_MAX_ROWS, two an SM) or rows of many chunks (from SPLIT_DEFAULT_MIN_BLOCK_N). On the
# H200 untuned online calls ran 2 x 12291808 fp16 at 0.6% of the copy bandwidth and 32 x 3738195
# bf16 at 6%, and every tuned entry past 131072 entries (512 x 524288 fp32, 2048 x 131072 bf16,
# 64-256 rows of 1-4M fp32) is a split kernel, of 4 programs an SM, 8 warps and chunks of 4096
# 16-bit or 2048 fp32 entries, as the default's.
SPLIT_DEFAULT_MAX_ROWS = 256
SPLIT_DEFAULT_MIN_BLOCK_N = 1 << 17
# A row's segments must all run at once. Four programs of 8 warps an SM fit by the kernels'
# registers as compiled here (32-58), yet on the H200 the cooperative launch refused 458 and 518
# programs of bf16 rows of 3738195 and 596536 entries (the launch now asks the compiled kernel's
# occupancy); the default sizes its segments for two an SM, so that a row fits wherever two do.
SPLIT_DEFAULT_SEGMENTS_PER_SM = 2
# Rows the online kernel runs in one wave (up to SPLIT_ONE_WAVE_MAX_ROWS: its one program a row, 8
# an SM by threads) end pass 1 together, so L2 holds only the last part of each row for pass 2 once
# what they read passes SPLIT_L2_BYTES: softmax's backward at 516 x 58896 bf16 read 122 MB of y and
# dy twice, mostly from memory (0.80x liger, which holds the row in one program;
# docs/perf-notes/softmax.md). SPLIT_ONE_WAVE sends such rows to the split kernel, which takes as
# many rows at once as L2 holds for pass 2. Off until measured (benchmarks/softmax_split_rows.py
# --settings one-wave times it): past one wave the rows' passes interleave and the online kernel won
# the tuning (8192 x 32768 bf16's backward, 131072 x 65536's both ways).
SPLIT_ONE_WAVE = False
SPLIT_ONE_WAVE_MAX_ROWS = 1024


def _tiles(key: dict) -> int:
    """Row tiles a one-pass program holds at once: x forward; y and dy backward."""
    return 1 if key["direction"] == "fwd" else 2


def _element_bytes(key: dict) -> int:
    return {"fp16": 2, "bf16": 2, "fp32": 4}[key["dtype"].split(">")[0]]


def _one_pass_fits(key: dict) -> bool:
    """The backward holds two tiles: half the forward's row, or all of it in bf16, which it keeps
    16-bit (see _widen_again; fp16 spilled). Over a leading dim a program holds COLS_MIN_BLOCK_M
    rows, with int64 entry offsets: half as much again."""
    if key["layout"] == "cols":
        return key["block_n"] * COLS_MIN_BLOCK_M * _tiles(key) <= ONE_PASS_MAX_BLOCK_N // 2
    packed = key["direction"] == "bwd" and key["dtype"].startswith("bf16")
    return key["block_n"] * _tiles(key) <= ONE_PASS_MAX_BLOCK_N * (2 if packed else 1)


def _staged_fits(config: dict, key: dict) -> bool:
    """A persistent one-pass config: rows layout, its staged blocks within STAGED_MAX_SHARED_BYTES."""
    element_bytes = _element_bytes(key)
    staged = config["BLOCK_M"] * key["block_n"] * element_bytes * _tiles(key) * (config["STAGES"] - 1)
    return key["layout"] == "rows" and staged <= STAGED_MAX_SHARED_BYTES


def _per_thread(config: dict, block_n: int) -> float:
    return config.get("BLOCK_M", 1) * config.get("BLOCK_N", block_n) / (32 * config["num_warps"])


def _split_fits(config: dict, key: dict) -> bool:
    """Rows of at least two segments and as many segments as programs fit at once, the values a
    thread holds within PER_THREAD, at least two chunks a segment, PER_SM programs within
    SPLIT_MAX_WARPS_PER_SM and the segments in flight (x, or y and dy) within SPLIT_L2_BYTES."""
    segments = key["block_n"] // config["SEGMENT"]
    programs = config["PER_SM"] * sm_count(current_device())
    if not (2 <= segments <= programs and key["layout"] == "rows"):
        return False
    threads = config["PER_SM"] * config["num_warps"] * 32
    element_bytes = _element_bytes(key)
    in_flight = programs * config["SEGMENT"] * element_bytes * _tiles(key)
    low, high = PER_THREAD["split"]
    return (
        low <= _per_thread(config, key["block_n"]) <= high
        and config["SEGMENT"] >= 2 * config["BLOCK_N"]
        and threads <= SPLIT_MAX_WARPS_PER_SM * 32
        and in_flight <= SPLIT_L2_BYTES
    )


def _default(key: dict) -> dict:
    """The untuned config: used under the interpreter and wherever tuning cannot run."""
    block_n, rows, cols = key["block_n"], key["rows"], key["layout"] == "cols"
    variant = key.get("variant", "auto")  # tuning keys hold none: they cover every variant
    if variant == "one-pass" or (variant == "auto" and _one_pass_fits(key)):
        warps = min(16, max(4, block_n * _tiles(key) // 1024))  # 32 values a thread for long rows
        if block_n * _tiles(key) > ONE_PASS_MAX_PER_THREAD * 32 * warps:  # the packed bf16 backward
            warps = 32
        block_m = max(1, min(rows, 16 * 32 * warps // block_n))
        if cols:  # entry offsets are runtime strides, held in int64: 32 values a thread at most
            block_m = max(block_m, min(rows, COLS_MIN_BLOCK_M))
            warps = min(16, max(4, block_m * block_n * _tiles(key) // 1024))
        config = {"variant": "one-pass", "BLOCK_M": block_m, "num_warps": warps}
        if (
            PERSISTENT_DEFAULT
            and block_m * block_n * _tiles(key) >= PERSISTENT_MIN_ENTRIES
            and _staged_fits({**config, "STAGES": 2}, key)
        ):
            config["STAGES"] = 2
        return config
    if variant == "split" or (variant == "auto" and not cols and _split_by_default(key)):
        return _split_default(key)
    if cols:
        return {
            "variant": "online",
            "BLOCK_M": min(64, max(COLS_MIN_BLOCK_M, rows)),
            "BLOCK_N": 64,
            "num_warps": 4,
        }
    chunk = min(4096, block_n)
    return {"variant": "online", "BLOCK_M": 1, "BLOCK_N": chunk, "num_warps": min(8, max(4, chunk // 512))}


def _split_by_default(key: dict) -> bool:
    """Whether the untuned default of an "auto" call splits its rows (see SPLIT_DEFAULT_MAX_ROWS and
    SPLIT_ONE_WAVE)."""
    return key["block_n"] >= 4 * 4096 and (
        key["rows"] <= SPLIT_DEFAULT_MAX_ROWS
        or key["block_n"] >= SPLIT_DEFAULT_MIN_BLOCK_N
        or _one_wave_past_l2(key)
    )


def _one_wave_past_l2(key: dict) -> bool:
    """The online kernel's rows in one wave, more of them than L2 holds for pass 2 (SPLIT_ONE_WAVE)."""
    return SPLIT_ONE_WAVE and key["rows"] <= SPLIT_ONE_WAVE_MAX_ROWS and _pass_two_bytes(key) > SPLIT_L2_BYTES


def _pass_two_bytes(key: dict) -> int:
    """What pass 2 reads again of every row of the key's bucket: x forward, y and dy backward."""
    return key["rows"] * key["block_n"] * _element_bytes(key) * _tiles(key)


def _split_default(key: dict) -> dict:
    """The split kernel's untuned config: segments of at least four chunks, as few segments a row
    as SPLIT_DEFAULT_SEGMENTS_PER_SM programs an SM hold, whatever L2 holds (a row past it is read
    twice from memory, as the online kernel reads it); up to 4 programs an SM take rows side by side.
    PREFETCH: pass 1 holds two chunks in flight. With one (8 KB a program, 32 KB an SM) the first
    sweep's split rows moved at 38-55% of the copy (tuned: 61-75%), where an SM wants about 36-55 KB
    in flight (the persistent one-pass note in docs/perf-notes/softmax.md); not yet measured."""
    chunk = 2048 if key["dtype"].startswith("fp32") else 4096  # 8 or 16 values a thread
    programs = SPLIT_DEFAULT_SEGMENTS_PER_SM * sm_count(current_device())
    segment = max(4 * chunk, next_power_of_2(-(-key["block_n"] // programs)))
    return {
        "variant": "split",
        "SEGMENT": segment,
        "BLOCK_N": chunk,
        "num_warps": 8,
        "PER_SM": 4,
        "PREFETCH": True,
    }


def _prune(config: dict, key: dict) -> bool:
    """True drops the config for this key: another variant than asked, a row that does not fit,
    too many or too few values a thread, rows beyond the problem or too few for coalescing; a split
    row of one segment, or of more than fit at once or in L2."""
    variant, asked = config["variant"], key.get("variant", "auto")
    if asked not in ("auto", variant) or (variant == "one-pass" and not _one_pass_fits(key)):
        return True
    if variant == "online" and (
        config["BLOCK_N"] > key["block_n"]
        or key["layout"] == "rows"
        and config["BLOCK_N"] < min(key["block_n"] // 4, ONLINE_MIN_ROWS_CHUNK)
    ):
        return True
    if variant == "split":
        return not _split_fits(config, key)
    if config.get("PREFETCH") and (
        key["layout"] != "rows"
        or key["block_n"] < 2 * config["BLOCK_N"]
        or _per_thread(config, key["block_n"]) > PREFETCH_MAX_PER_THREAD
    ):
        return True
    low, high = PER_THREAD[variant]
    held = _per_thread(config, key["block_n"]) * (_tiles(key) if variant == "one-pass" else 1)
    min_block_m = min(key["rows"], COLS_MIN_BLOCK_M) if key["layout"] == "cols" else 1
    return not (low <= held <= high and min_block_m <= config["BLOCK_M"] <= max(1, key["rows"]))
