"""The benchmarks page's numbers: the same in both languages, and the measured ones as measured.

``docs/benchmarks.md`` quotes its numbers by hand (only its figures are drawn from
``bench/results``), and ``docs/benchmarks.zh.md`` says the same in Chinese. Two checks hold
them: every section of the Chinese page, and every table in it, quotes the same numbers as the
English one, as many times (a multiset, thousands separators dropped); and the English page's
tables, with a few figures of its text, are what the full runs wrote to ``bench/results/*.json``,
formatted as the page writes them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.common

ROOT = Path(__file__).resolve().parent.parent
DOCS, RESULTS = ROOT / "docs", ROOT / "bench" / "results"
ENGLISH, CHINESE = DOCS / "benchmarks.md", DOCS / "benchmarks.zh.md"

# What is not a number of the argument: link targets, heading ids, and names with digits in them.
NOT_NUMBERS = re.compile(
    r"\]\([^)]*\)|\{#[^}]*\}|[Ss]tage \d+|Figure \d+\w?|§\d+(?:\.\d+)?|Table \d+|\bV[01]\b|\bp(?:50|99)\b"
    r"|OPT-\d+B|LLaMA-\d+B|Llama-3-\d+B|A100-\d+GB|Qwen2\.5-0\.5B|qwen2\.5-0\.5b|0\.5B|x86-64|WMT16"
    r"|CTranslate2|b?float\d+|log_softmax|\bv[12]\b"
)
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def numbers(text: str) -> Counter[str]:
    return Counter(n.replace(",", "") for n in NUMBER.findall(NOT_NUMBERS.sub(" ", text)))


def sections(page: Path) -> list[tuple[str, str]]:
    """The page cut at its ``##`` headings: (heading, body), the introduction first."""
    parts = re.split(r"^## (.*)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return [("(introduction)", parts[0])] + list(zip(parts[1::2], parts[2::2], strict=True))


def tables(body: str) -> tuple[list[str], str]:
    """A section's tables, each as its text, and the rest of the section."""
    found, rest, current = [], [], []
    for line in body.splitlines():
        if line.startswith("|"):
            current.append(line)
            continue
        if current:
            found.append("\n".join(current))
            current = []
        rest.append(line)
    if current:
        found.append("\n".join(current))
    return found, "\n".join(rest)


def script(heading: str) -> str:
    """The section's script (`memory_utilization.py`), which names it in both languages."""
    match = re.search(r"`(\w+\.py)`", heading)
    return match.group(1) if match else heading


def compare(english: str, chinese: str) -> list[str]:
    """The differences between two sections' numbers: tables one by one, then the prose."""
    problems = []
    en_tables, en_prose = tables(english)
    zh_tables, zh_prose = tables(chinese)
    if len(en_tables) != len(zh_tables):
        return [f"{len(en_tables)} tables in English, {len(zh_tables)} in Chinese"]
    for i, (en, zh) in enumerate(zip(en_tables, zh_tables, strict=True), 1):
        if numbers(en) != numbers(zh):
            problems.append(f"table {i}: only English {numbers(en) - numbers(zh)}, "
                            f"only Chinese {numbers(zh) - numbers(en)}")
    if numbers(en_prose) != numbers(zh_prose):
        problems.append(f"text: only English {numbers(en_prose) - numbers(zh_prose)}, "
                        f"only Chinese {numbers(zh_prose) - numbers(en_prose)}")
    return problems


def test_the_pages_have_the_same_sections():
    assert [script(h) for h, _ in sections(ENGLISH)] == [script(h) for h, _ in sections(CHINESE)]
    assert len(sections(ENGLISH)) >= 14


@pytest.mark.parametrize("index", range(len(sections(ENGLISH))), ids=lambda i: script(sections(ENGLISH)[i][0]))
def test_the_chinese_page_quotes_the_english_pages_numbers(index: int):
    (heading, english), (_, chinese) = sections(ENGLISH)[index], sections(CHINESE)[index]
    problems = compare(english, chinese)
    assert not problems, f"{heading}:\n" + "\n".join(problems)


def test_the_comparison_sees_one_number_changed():
    _, english = sections(ENGLISH)[1]
    assert not compare(english, english)
    assert compare(english, english.replace("26.4%", "26.5%", 1))  # in a table
    assert compare(english, english.replace("1.6% free", "1.7% free", 1))  # in the text
    assert not compare("1,000 slots", "1000 个槽位")  # separators and words apart


# The English page against bench/results.


def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


@cache
def english_tables() -> dict[str, list[list[list[str]]]]:
    """Each section's tables, by its script: rows of cells, the header and the rule left out, bold dropped."""
    found = {}
    for heading, body in sections(ENGLISH):
        found[script(heading)] = [
            [[cell.strip().strip("*") for cell in row.strip().strip("|").split("|")] for row in table.splitlines()[2:]]
            for table in tables(body)[0]
        ]
    return found


def text_of(name: str) -> str:
    return next(" ".join(body.split()) for heading, body in sections(ENGLISH) if script(heading) == name)


def pct(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def test_where_the_memory_goes():
    data = result("memory_utilization")
    (table,) = english_tables()["memory_utilization.py"]
    kinds = ("token", "reserved", "internal", "external")
    expected = [[pct(data[p]["fractions"][k]) for k in kinds] + [f"{data[p]['paper_token_share']}%"]
                for p in ("max", "pow2", "oracle", "paged/16")]
    assert [row[1:] for row in table] == expected
    assert f"({pct(data['paged/16']['fractions']['free'])} free)" in text_of("memory_utilization.py")


def test_how_many_requests_run_at_once():
    data = result("batch_capacity")
    (table,) = english_tables()["batch_capacity.py"]
    policies = ("max", "pow2", "oracle", "paged")
    assert table[0][1:] == [f"{data['results']['ShareGPT/0.2'][p]:.2f}" for p in policies]
    assert table[1][1:] == [f"{data['paper_sharegpt_2rps'][p]:.2f}" for p in policies]
    alpaca = {p: f"{data['results']['Alpaca/0.2'][p]:.0f}" for p in policies}
    assert (f"runs {alpaca['paged']} requests at once at the highest rate, against {alpaca['max']} (`max`), "
            f"{alpaca['pow2']} (`pow2`) and {alpaca['oracle']} (`oracle`)") in text_of("batch_capacity.py")
    assert f"{data['slots']:,} token slots" in text_of("batch_capacity.py")


def test_how_many_requests_an_fp8_cache_runs_at_once():
    data = result("batch_capacity")
    bound, at_02 = data["memory_bound"], data["results"]["ShareGPT/0.2"]
    a, b = bound["ShareGPT/0.5"], bound["ShareGPT/1.0"]
    assert (f"the same 12 GiB hold {data['fp8_slots']:,} token slots. At 0.2 arrivals a step it runs "
            f"{at_02['paged_fp8']:.2f} requests at once") in text_of("batch_capacity.py")
    assert (f"paged memory runs {a['paged']:.2f} and {b['paged']:.2f}, the FP8 cache {a['paged_fp8']:.2f} and "
            f"{b['paged_fp8']:.2f}: {a['paged_fp8'] / a['paged']:.2f}× and {b['paged_fp8'] / b['paged']:.2f}×"
            ) in text_of("batch_capacity.py")


def fp8_rows(page_text: str) -> list[list[str]]:
    """The rows of the table of drifts in a page's text (a stage page, or the benchmarks page)."""
    return [[cell.strip() for cell in line.strip("|").split("|")][2:] for line in page_text.splitlines()
            if re.match(r"\| (tiny|Qwen2\.5-0\.5B-shaped) \| e4m3", line)]


def test_an_fp8_kv_cache():
    """The drifts, as bench/fp8_kv_cache.py measured them, on this page and on stage 13's, in both languages."""
    data = result("fp8_kv_cache")
    expected = [[f"{r['max_token_logprob_drift']:.3f}", f"{r['mean_token_logprob_drift']:.3f}",
                 f"{r['max_text_loglikelihood_drift']:.2f}", f"{r['identical']:.0%}",
                 f"{r['tokens_before_first_difference']:.0%}"]
                for model in ("tiny", "qwen2.5-0.5b-shaped") for r in (data["results"][model][m]
                                                                     for m in ("fp8", "fp8, calibrated"))]
    (table,) = english_tables()["fp8_kv_cache.py"]
    assert [row[2:] for row in table] == expected
    for page in (ENGLISH, CHINESE, DOCS / "stages" / "13_fp8_kv_cache.md", DOCS / "stages" / "13_fp8_kv_cache.zh.md"):
        assert fp8_rows(page.read_text(encoding="utf-8")) == expected, page.name
    speed = data["tokens_per_second"]
    assert (f"{speed['auto']:,.0f} tokens/s with the float32 cache, {speed['fp8']:,.0f} in e4m3 with scales 1.0 "
            f"and {speed['fp8, calibrated']:,.0f} calibrated") in text_of("fp8_kv_cache.py")
    for page in ("13_fp8_kv_cache.md", "13_fp8_kv_cache.zh.md"):
        assert f"{speed['fp8, calibrated'] / speed['auto']:.2f}" in (DOCS / "stages" / page).read_text(encoding="utf-8")


def test_block_size():
    utilisation = result("block_size")["utilisation"]
    (table,) = english_tables()["block_size.py"]
    assert [row[1:] for row in table] == [[pct(utilisation[f"{trace}/{size}"]["token"]) for size in (1, 4, 16, 64, 256)]
                                          for trace in ("ShareGPT", "Alpaca")]


def test_swap_or_recompute():
    data = result("swap_vs_recompute")
    rows = data["rows"]
    text = text_of("swap_vs_recompute.py")
    larger = sorted(f"{rows[size]['swap_ms']:.1f}" for size in rows if int(size) >= 16)
    assert f"One preempted sequence of {data['tokens']} tokens" in text
    assert f"costs {rows['1']['swap_ms']:.1f} ms with blocks of 1 token and {larger[0]}–{larger[-1]} ms" in text
    assert f"about {rows['16']['recompute_ms']:.0f} ms of prefill" in text


def test_sharing():
    saving = result("sharing")["saving"]
    table, v1 = english_tables()["sharing.py"]
    for engine, rows, cells in (("", table, (1, 3)), ("V1/", v1, (1, 2))):
        for row, trace in zip(rows, ("ShareGPT", "Alpaca"), strict=True):
            for cell, kind in zip((row[i] for i in cells), ("parallel", "beam"), strict=True):
                assert cell == " / ".join(f"{100 * saving[f'{engine}{trace}/{kind}/{n}']:.1f}" for n in (2, 4, 6)) + "%"


def test_prefix_caching():
    data = result("prefix_caching")
    (table,) = english_tables()["prefix_caching.py"]
    for row, prefix in zip(table, ("one-shot", "five-shot"), strict=True):
        off, on = data[f"{prefix}/off"], data[f"{prefix}/on"]
        assert row[1:] == [f"{off['prefill_tokens']:,} → {on['prefill_tokens']:,}", f"{on['hits']}",
                           f"{on['requests_per_s'] / off['requests_per_s']:.1f}×"]


def two_figures(ms: float) -> str:
    return f"{ms:.2g}"


def test_chunked_prefill():
    rows = result("chunked_prefill")["rows"]
    table = english_tables()["chunked_prefill.py"][0]
    names = ("stage 9 (whole prompt)", "stage 10, budget 64", "stage 10, budget 256", "stage 10, budget 1024")
    assert [row[1:] for row in table] == [
        [f"{two_figures(r['itl_p50_ms'])} / {two_figures(r['itl_p99_ms'])} ms", f"{two_figures(r['worst_step_ms'])} ms",
         f"{two_figures(r['ttft_ms'])} ms", f"{r['steps']}"] for r in map(rows.get, names)]


def test_time_outside_the_forward():
    rows = result("step_overhead")["rows"]
    table = english_tables()["chunked_prefill.py"][1]
    assert [row[0] for row in table] == [f"{r['engine']}, batch {r['batch']}" for r in rows]
    assert [row[1:] for row in table] == [
        [f"{r['step_ms']:.2f} ms", f"{r['forward_ms']:.2f} ms",
         f"{r['outside_ms']:.2f} ms ({100 * r['outside_share']:.0f}%)"]
        + [f"{r[k]:.2f}" for k in ("schedule_ms", "inputs_ms", "sample_ms", "rest_ms")] for r in rows]


def test_the_host_path_beside_nano_vllms():
    data = result("host_path")
    (table,) = english_tables()["host_path.py"]
    assert [row[0] for row in table] == [str(r["batch"]) for r in data["rows"]]
    assert [row[1:] for row in table] == [
        [f"{r['minipaged_ms']:.2f} ms", f"{r['nano_vllm_ms']:.2f} ms", f"{r['ratio']:.2f}×"] for r in data["rows"]]
    assert data["nano_vllm"].split(" (")[0] in text_of("host_path.py")  # which nano-vllm it was


def test_tensor_parallel_step_time():
    rows = result("tensor_parallel")["step_time"]
    (table,) = english_tables()["tensor_parallel.py"]
    assert [row[1:] for row in table] == [[f"{r['step_ms']:.3g} ms" for r in rows if r["model"] == model]
                                          for model in ("tiny", "qwen2.5-0.5b-shaped")]
    kv = {row["tp"]: row["kv_bytes_per_token_per_worker"][0] for row in result("tensor_parallel")["kv"]}
    assert (f"take {kv[1]:,} bytes in one process, {kv[2]:,} on each worker at tp 2, and {kv[4]:,} again at tp 4"
            in text_of("tensor_parallel.py"))


def test_speculative_decoding():
    rows = {(r["batch"], r["k"], r["workload"]): r for r in result("speculative")["rows"]}
    (table,) = english_tables()["speculative.py"]
    assert len(table) == len(rows) // 2
    for row in table:
        batch, k = int(row[0]), int(row[1])
        expected = []
        for workload in ("repetitive", "random"):
            r = rows[batch, k, workload]
            expected += [f"{r['acceptance_rate']:.2f}", f"{r['tokens_per_forward']:.2f}",
                         f"{r['formula_tokens_per_forward']:.2f}", f"{r['speedup']:.2f}×"]
        assert row[2:] == expected, (batch, k)


def test_a_hybrid_kv_cache():
    """Requests resident at one memory, hybrid beside every layer full, and the blocks the windows give back,
    as bench/hybrid_capacity.py measured them; the tiny model's throughput in the text."""
    data = result("hybrid_capacity")
    capacity, speed = data["capacity"], data["throughput"]
    full, by = capacity["every_layer_full"], {(r["pattern"], r["window"]): r for r in capacity["rows"]}
    windows, patterns = (128, 1024, 4096), ("1:1", "5:1", "all sliding")
    resident, given = english_tables()["hybrid_capacity.py"]
    assert resident[0][1:] == [f"{full['num_blocks']:,} ({full['layers_per_block']})"] + [
        f"{full['mean_running']:.1f}"] * len(windows)
    for row, pattern in zip(resident[1:], patterns, strict=True):
        rows = [by[pattern, w] for w in windows]
        assert row[1:] == [f"{rows[0]['num_blocks']:,} ({rows[0]['layers_per_block']})"] + [
            f"{r['mean_running']:.1f} ({r['ratio']:.2f}×)" for r in rows]
    assert [row[1:] for row in given] == [
        [f"{by[p, w]['given_back_per_step']:.1f} ({by[p, w]['given_back_mib_per_step']:.0f} MiB)" for w in windows]
        for p in patterns]
    text = text_of("hybrid_capacity.py")
    assert (f"{capacity['requests']:,} ShareGPT-like requests ({capacity['mean_request_tokens']:.0f} tokens on "
            f"average, at most {capacity['max_request_tokens']:,})") in text
    assert (f"the scheduler preempted {full['preemptions']:,} times, at 5:1 with a window of 128 it preempted "
            f"{by['5:1', 128]['preemptions']:,} times") in text
    hybrid, kept = speed["hybrid"], speed["every_layer_full"]
    assert (f"decodes {hybrid['decodes_per_step']:.1f} requests a step against {kept['decodes_per_step']:.1f}, "
            f"finishes in {hybrid['steps']} steps against {kept['steps']} and preempts {hybrid['preemptions']} "
            f"times against {kept['preemptions']}: {hybrid['tokens_per_s']:,.0f} tokens per CPU second against "
            f"{kept['tokens_per_s']:,.0f} ({speed['ratio']:.2f}×)") in text
    assert f"{hybrid['ms_per_step']:.2f} ms of CPU against {kept['ms_per_step']:.2f}" in text


def test_serving_under_load():
    held = result("serving")["held"]
    (table,) = english_tables()["serving.py"]
    highest = 192  # the highest rate tried on Alpaca-like requests
    for row, trace in zip(table, ("ShareGPT", "Alpaca"), strict=True):
        assert row[1:] == [f"{held[trace][p]}" + (" or more" if trace == "Alpaca" and held[trace][p] == highest else "")
                           for p in ("paged", "oracle", "pow2", "max")]
    measured = result("serving")["results"]
    # The threshold is 5 times the paged engine's normalized latency at the lowest rate.
    lowest = {trace: min(r["paged"].items(), key=lambda item: float(item[0]))[1] for trace, r in measured.items()}
    assert all(held[t]["threshold_ms_per_token"] == pytest.approx(5e3 * lowest[t]["normalized_latency"])
               for t in lowest)
    threshold = {trace: f"{held[trace]['threshold_ms_per_token']:.0f}" for trace in held}
    assert f"({threshold['ShareGPT']} ms/token for ShareGPT, {threshold['Alpaca']} for Alpaca)" in text_of("serving.py")
    latency = {p: f"{1e3 * r['48']['normalized_latency']:.0f}" for p, r in measured["ShareGPT"].items()}
    assert (f"paged {latency['paged']} ms/token, `oracle` {latency['oracle']}, `pow2` {latency['pow2']}, "
            f"`max` {latency['max']}") in text_of("serving.py")


@pytest.mark.parametrize(("name", "index", "tps"),
                         [("throughput", 0, "{:,.0f}"), ("throughput_qwen2.5-0.5b-shaped", 1, "{:.1f}")])
def test_throughput(name: str, index: int, tps: str):
    rows = result(name)["rows"]
    table = english_tables()["throughput.py"][index]
    ct2 = "{:.2f}×" if index == 0 else "{:.1f}×"
    assert [row for row in table] == [
        [f"{r['batch']}", tps.format(r["minipaged_tps"]), tps.format(r["transformers_tps"]), f"{r['ratio']:.1f}×",
         tps.format(r["transformers_cb_tps"]), f"{r['ratio_cb']:.1f}×", tps.format(r["ctranslate2_tps"]),
         ct2.format(r["ratio_ct2"])] for r in rows]


def test_the_throughput_ceiling_with_nothing_outside_the_forward():
    """Minipaged's rate over its share of time in the forward: what it would reach if scheduling,
    bookkeeping, inputs and sampling cost nothing."""
    rows = result("throughput")["rows"]
    ceiling = [f"{r['ratio_cb'] / (1 - r['outside_forward']):.1f}×" for r in rows]
    batches = [f"{r['batch']}" for r in rows]
    first = rows[0]
    assert (f"at most {ceiling[0]}, {ceiling[1]} and {ceiling[2]} continuous batching's rate at batch "
            f"{batches[0]}, {batches[1]} and {batches[2]}" in text_of("throughput.py"))
    assert (f"and {first['ratio'] / (1 - first['outside_forward']):.1f}× `generate`'s at batch {first['batch']}"
            in text_of("throughput.py"))


def test_threads_on_a_busy_machine():
    rows = {(r["condition"], r["threads"]): r["tokens_per_s"] for r in result("threads")["rows"]}
    (table,) = english_tables()["threads.py"]
    assert [row[1:] for row in table] == [[f"{rows[condition, n]:,.0f} tokens/s" for n in (1, 2)]
                                          for condition in ("as it is", "one core busy")]


def test_the_readmes_fp8_row_is_the_benchmarks():
    bound = result("batch_capacity")["memory_bound"]["ShareGPT/1.0"]
    row = f"{bound['paged']:.1f} / **{bound['paged_fp8']:.1f}** ({bound['paged_fp8'] / bound['paged']:.2f}×)"
    assert row in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readmes_disaggregated_row_is_the_benchmarks():
    rows = result("disaggregated")["summary"]
    one, split = rows["one engine, 1 thread"], rows["producer + consumer"]
    row = (f"{one['itl_p99_ms']:,.0f} / **{split['itl_p99_ms']:,.0f}** ms "
           f"({one['itl_p99_ms'] / split['itl_p99_ms']:.1f}× lower)")
    assert row in (ROOT / "README.md").read_text(encoding="utf-8")


def test_stage_13s_lm_eval_table_is_the_runs():
    """bench/lm_eval/run.sh through the server, its comparisons kept in bench/results/lm_eval_fp8.json."""
    data = result("lm_eval_fp8")
    expected = []
    for label in ("auto", "fp8", "fp8_calibrated"):
        drift, metrics = data[label]["loglikelihood_drift"], data[label]["metrics"]
        requests = sum(task["requests"] for task in drift.values())
        mean = sum(task["mean"] * task["requests"] for task in drift.values()) / requests
        expected.append([f"{metrics['minipaged_tiny_mc']['acc,none'][0]:.2f}",
                         f"{metrics['minipaged_tiny_mc']['acc_norm,none'][0]:.2f}",
                         f"{metrics['minipaged_tiny_ppl']['bits_per_byte,none'][0]:.4f}",
                         f"{max(task['largest'] for task in drift.values()):.3g}", f"{mean:.3g}"])
    for page in ("13_fp8_kv_cache.md", "13_fp8_kv_cache.zh.md"):
        lines = (DOCS / "stages" / page).read_text(encoding="utf-8").splitlines()
        rows = [[cell.strip() for cell in line.strip("|").split("|")][1:] for line in lines
                if re.match(r"\| (float32|e4m3)[ ,，（(]", line)]
        assert rows == expected, page


def disaggregated_rows(data: dict) -> list[list[str]]:
    return [[name, f"{r['itl_no_burst_ms']:,.0f}", f"{r['itl_p50_ms']:,.0f}", f"{r['itl_p99_ms']:,.0f}",
             f"{r['itl_max_ms']:,.0f}", f"{r['ttft_mean_ms']:,.0f}"] for name, r in data["summary"].items()]


def test_disaggregated_prefill():
    """The decodes' inter-token latency during a burst, as bench/disaggregated.py measured it, on this page and
    on stage 14's page; the bytes moved per request equal to the formula."""
    data = result("disaggregated")
    (table,) = english_tables()["disaggregated.py"]
    assert table == disaggregated_rows(data)
    moved = data["bytes_per_request"]
    assert moved["measured"] == moved["formula"]
    assert f"{moved['measured']:,.0f} bytes" in text_of("disaggregated.py")
    for page in ("14_disaggregated_prefill.md", "14_disaggregated_prefill.zh.md"):  # the table after the marker
        marker = "<!-- bench/results/disaggregated.json -->"
        text = (DOCS / "stages" / page).read_text(encoding="utf-8").split(marker)[1]
        rows = [[c.strip().strip("*") for c in line.strip().strip("|").split("|")]
                for line in tables(text)[0][0].splitlines()[2:]]
        assert [row[1:] for row in rows] == [row[1:] for row in disaggregated_rows(data)], page
