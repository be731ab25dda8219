"""The live page: ``snapshot()`` read from a real engine, and the page drawn in headless Chromium.

The snapshot is checked against the block manager's own bookkeeping (reference counts, free
blocks, swapped tables) on the tiny model, with parallel samples sharing blocks and a request
swapped out to the CPU pool. The page is served by the real application (``build_app``, in a
thread) at 64 and at 8,192 blocks, with requests running (``n = 2`` among them): it must fit one
1280 x 900 screen, give each request its own colour, show a request's block table on hover and
on click, and never parse generated text as HTML.
"""

import math
import shutil
import socket
import threading
import time
from functools import partial

import httpx
import pytest

from minipaged import LLM as _LLM
from minipaged import SamplingParams
from minipaged.serving.engine_client import snapshot
from minipaged.serving.live_page import PAGE

LLM = partial(_LLM, scheduler="v0")  # V0's scheduler (stage 6): n > 1, beams and swap, as this file serves them

pytestmark = pytest.mark.serving

PROMPT = list(range(11, 21))  # 10 tokens: two full blocks of 4, and 2 tokens in a third


def run(llm, steps):
    for _ in range(steps):
        llm.engine.step()


def check_against_the_manager(llm, snap):
    """Every block in use is listed once per sequence holding it; nothing else is in use."""
    manager = llm.scheduler.block_manager
    assert len(snap["blocks"]) == snap["num_blocks"] - snap["free_blocks"] == (
        manager.num_total_blocks - manager.num_free_blocks)
    for block, owners in snap["blocks"].items():
        assert len(owners) == manager.ref_count(int(block))
    assert snap["shared"] == sorted(int(b) for b, o in snap["blocks"].items() if manager.ref_count(int(b)) > 1)


def test_snapshot_lists_owners_shared_prompt_blocks_and_each_sequence_table():
    llm = LLM("tiny", block_size=4, num_gpu_blocks=64, max_model_len=64)
    sampled = SamplingParams(n=3, max_tokens=20, temperature=0.8, seed=0, ignore_eos=True)
    llm.engine.add_request("a", {"prompt_token_ids": PROMPT}, sampled)
    llm.engine.add_request("b", {"prompt_token_ids": PROMPT[:5]}, SamplingParams(max_tokens=20, ignore_eos=True))
    snap = snapshot(llm)
    assert [r["id"] for r in snap["waiting"]] == ["a", "b"] and not snap["running"] and not snap["blocks"]
    assert snap["waiting"][0]["seqs"][0]["where"] is None and snap["free_blocks"] == 64
    assert snap["cpu"] is None  # no swap space

    run(llm, 1)  # both prompts prefilled; "a" forked into 3 samples that share all 3 prompt blocks
    snap = snapshot(llm)
    a, b = snap["running"]
    assert (a["id"], a["width"], a["tokens"], b["tokens"]) == ("a", 3, [1, 1, 1], [1])
    tables = [s["block_table"] for s in a["seqs"]]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert all(snap["blocks"][str(blk)] == ["a"] * 3 for blk in tables[0])
    assert set(snap["shared"]) == set(tables[0])
    assert len(b["seqs"][0]["block_table"]) == 2 and a["gpu_blocks"] == 3 and b["gpu_blocks"] == 2
    assert snap["free_blocks"] == 64 - 5
    check_against_the_manager(llm, snap)

    run(llm, 1)  # each sample writes into the shared last block: copy-on-write gives each its own
    snap = snapshot(llm)
    a = snap["running"][0]
    tables = [s["block_table"] for s in a["seqs"]]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the two full prompt blocks stay shared
    assert len({t[2] for t in tables}) == 3  # three different last blocks
    assert set(snap["shared"]) == set(tables[0][:2]) and a["gpu_blocks"] == 2 + 3
    assert [s["num_tokens"] for s in a["seqs"]] == [12, 12, 12] and a["tokens"] == [2, 2, 2]
    for seq, want in zip(a["seqs"], tables, strict=True):
        assert seq["block_table"] == want and seq["where"] == "gpu" and seq["status"] == "running"
    check_against_the_manager(llm, snap)
    assert all(isinstance(s["text"], str) for s in a["seqs"])


def swapped_engine():
    """Three requests on 16 GPU blocks of 4 tokens; the newest (n=2) is swapped out to the CPU."""
    llm = LLM("tiny", block_size=4, num_gpu_blocks=16, num_cpu_blocks=32, max_model_len=32,
              preemption_mode="swap")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.engine.add_request("a", {"prompt_token_ids": PROMPT[:8]}, greedy)
    llm.engine.add_request("b", {"prompt_token_ids": PROMPT[1:9]}, greedy)
    llm.engine.add_request("c", {"prompt_token_ids": PROMPT[2:10]},
                           SamplingParams(n=2, max_tokens=24, temperature=0.8, seed=1, ignore_eos=True))
    for _ in range(40):
        llm.engine.step()
        if llm.scheduler.swapped:
            return llm
    raise AssertionError("no request was swapped out")


def test_snapshot_shows_the_cpu_swap_pool_and_whose_blocks_are_there():
    llm = swapped_engine()
    snap = snapshot(llm)
    assert [r["id"] for r in snap["swapped"]] == ["c"]  # the newest is preempted
    assert [r["id"] for r in snap["running"]] == ["a", "b"]
    c = snap["swapped"][0]
    assert len(c["seqs"]) == 2 and all(s["where"] == "cpu" for s in c["seqs"]) and c["gpu_blocks"] == 0
    cpu_tables = [s["block_table"] for s in c["seqs"]]
    held = {blk for t in cpu_tables for blk in t}
    assert cpu_tables[0][:2] == cpu_tables[1][:2]  # the shared prompt blocks moved once, still shared
    assert len(held) == c["cpu_blocks"] < sum(map(len, cpu_tables))
    cpu = snap["cpu"]
    assert cpu["num_blocks"] == 32 and cpu["free_blocks"] == 32 - len(held)
    assert set(map(int, cpu["blocks"])) == held and all(set(o) == {"c"} for o in cpu["blocks"].values())
    assert set(cpu["shared"]) == set(cpu_tables[0][:2])
    assert all(o != ["c"] and "c" not in o for o in snap["blocks"].values())  # nothing of c on the GPU
    assert c["tokens"] == [len(s.output_token_ids) for s in llm.scheduler.swapped[0].seqs]
    check_against_the_manager(llm, snap)


def test_the_page_loads_nothing_from_outside_and_never_parses_text_as_html():
    for outside in ("http:", "https:", "src=", "@import", "url("):
        assert outside not in PAGE
    for parser in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
        assert parser not in PAGE


# --- the page in a real browser ---------------------------------------------------------------

needs_browser = pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                                   reason="needs Debian's chromium and chromium-driver (make installs them "
                                          "where it can)")


def serve(llm):
    import uvicorn

    from minipaged.serving import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(llm), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, thread, url
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("the server did not start")


def stream_until(url, body, stop: threading.Event):
    """Stream one completion until ``stop`` is set, then go away (the server aborts the request)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,900",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):  # offline but for us
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False})
    yield driver
    driver.quit()


CELLS = """return [...document.querySelectorAll(arguments[0] + ' .block')].map(c => {
  const r = c.getBoundingClientRect(), st = getComputedStyle(c);
  const image = st.backgroundImage;  // a cell of several blocks: a stripe of colour per block
  return {owner: c.dataset.owner, title: c.title, bottom: r.bottom, right: r.right, width: r.width,
          colours: image === 'none' ? [st.backgroundColor] : image.match(/rgba?\\([^)]*\\)/g)};
});"""
FIND = "return [...document.querySelectorAll('#blocks .block')].find(c => c.dataset.owner === arguments[0])"
ROWS = """return [...document.querySelectorAll(arguments[0] + ' tr[data-request]')].map(
  tr => ({id: tr.cells[0].textContent, colour: getComputedStyle(tr.cells[0]).color,
          swatch: tr.querySelector('.swatch') && getComputedStyle(tr.querySelector('.swatch')).backgroundColor,
          cells: [...tr.cells].map(c => c.textContent)}));"""


@needs_browser
@pytest.mark.parametrize("num_blocks", [64, 8192])
def test_the_page_fits_one_screen_colours_requests_and_shows_block_tables(num_blocks, browser, monkeypatch):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    llm = LLM("tiny", num_gpu_blocks=num_blocks, num_cpu_blocks=32, max_model_len=256)
    step = llm.engine.step

    def slow_step():  # a step every 50 ms at most: the requests stay running while the page is read
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    server, thread, url = serve(llm)
    stop, clients = threading.Event(), []
    bodies = [{"prompt": "Return the number of", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True},
              {"prompt": "Create a new", "max_tokens": 200, "n": 2, "temperature": 0.8, "seed": 3,
               "ignore_eos": True},
              {"prompt": "The cat", "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}]
    try:
        for body in bodies:
            clients.append(threading.Thread(target=stream_until, args=(url, {**body, "stream": True}, stop)))
            clients[-1].start()
        browser.get(f"{url}/?every=200")
        wait = WebDriverWait(browser, 60, poll_frequency=0.1)
        wait.until(lambda b: "3 running" in b.find_element(By.ID, "summary").text)
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#texts tr")) == 4)  # 1 + 2 samples + 1
        state = httpx.get(f"{url}/state").json()
        ids = {r["id"]: r for r in state["running"]}
        sampled = next(r for r in state["running"] if r["width"] == 2)

        # one screen: nothing to scroll, and every block is drawn inside its panel
        size = browser.execute_script("const e = document.scrollingElement; "
                                      "return [e.scrollWidth, e.scrollHeight, innerWidth, innerHeight]")
        assert size[2:] == [1280, 900] and size[0] <= 1280 and size[1] <= 900, size
        per = int(browser.execute_script("return maps.gpu.per"))
        cells = browser.execute_script(CELLS, "#blocks")
        assert len(cells) == math.ceil(num_blocks / per) and (per == 1) == (num_blocks == 64)
        area = browser.find_element(By.ID, "gpu-area").rect
        assert max(c["bottom"] for c in cells) <= area["y"] + area["height"] + 0.5
        assert max(c["right"] for c in cells) <= area["x"] + area["width"] + 0.5
        assert min(c["width"] for c in cells) >= 5  # large enough to point at
        legend = browser.find_element(By.ID, "gpu-legend").text
        assert ("one block" in legend) if per == 1 else (f"{per} blocks" in legend)
        assert "0 of 32" in browser.find_element(By.ID, "cpu-title").text

        # one colour per request, the same in the block map, the queue table and the streaming text
        def drawn(b):  # every running request holds a block on the map
            cells = b.execute_script(CELLS, "#blocks")
            return cells if set(ids) <= {o for c in cells for o in c["title"].split(", ") if o} else None

        cells = wait.until(drawn)
        rows = {row["id"]: row for row in browser.execute_script(ROWS, "#queues")}
        texts = browser.execute_script(ROWS, "#texts")
        colours = {request_id: rows[request_id]["swatch"] for request_id in ids}
        assert len(set(colours.values())) == len(ids)
        for request_id, colour in colours.items():
            painted = [c for c in cells if colour in c["colours"]]
            assert painted and all(request_id in c["title"].split(", ") for c in painted)
            if per == 1:  # a block of its own: exactly its colour
                assert all(c["colours"] == [colour] for c in cells if c["title"] == request_id)
            assert rows[request_id]["colour"] == colour
            streaming = [t for t in texts if t["id"] == request_id]
            assert streaming and all(t["colour"] == colour for t in streaming)
        # the n = 2 request: two token counts in the table, one text per sample
        assert len(rows[sampled["id"]]["cells"][2].split("·")) == 2
        assert [t["cells"][1] for t in texts if t["id"] == sampled["id"]] == ["#0", "#1"]

        # hover over a block of the n = 2 request: its block table, logical -> physical, per sequence
        cell = wait.until(lambda b: b.execute_script(FIND, sampled["id"]))
        ActionChains(browser).move_to_element(cell).perform()
        wait.until(lambda b: sampled["id"] in b.find_element(By.ID, "detail-title").text)
        chips = browser.execute_script("return [...document.querySelectorAll('#table .chips')].map("
                                       "c => [...c.children].map(x => x.textContent))")
        state = httpx.get(f"{url}/state").json()
        now = next(r for r in state["running"] if r["id"] == sampled["id"])
        assert len(chips) == 2
        for shown, seq in zip(chips, now["seqs"], strict=True):
            pairs = [tuple(map(int, chip.split("→"))) for chip in shown]
            assert [logical for logical, _ in pairs] == list(range(len(pairs)))
            assert pairs[0] == (0, seq["block_table"][0])  # the prompt's block never moves
        if per == 1:  # the line under the title names the block pointed at and who holds it
            block = int(cell.get_attribute("data-cell"))
            assert f"block {block}:" in browser.find_element(By.ID, "hover").text
            assert any(block in s["block_table"] for s in now["seqs"])

        # click another request's block: its table stays after the pointer leaves
        other = next(r for r in ids if r != sampled["id"])
        cell = wait.until(lambda b: b.execute_script(FIND, other))
        ActionChains(browser).move_to_element(cell).click().perform()
        ActionChains(browser).move_to_element(browser.find_element(By.TAG_NAME, "h1")).perform()
        time.sleep(0.5)  # a few refreshes later
        assert other in browser.find_element(By.ID, "detail-title").text
        assert len(browser.find_elements(By.CSS_SELECTOR, "#table .chips")) == 1

        # generated text goes in as text: a text that looks like HTML stays text
        hostile = '<img id="evil" src="x" onerror="window.pwned = 1">'
        shown = browser.execute_script("""const s = structuredClone(state);
            s.running[0].text = s.running[0].seqs[0].text = arguments[0];
            draw(s);
            return [document.getElementById('evil') === null, document.getElementById('texts').textContent];
            """, hostile)
        assert shown[0] and hostile in shown[1]
        assert browser.execute_script("return window.pwned === undefined")

        # nothing was fetched from anywhere but the server
        resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(r.startswith(url) for r in resources)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=30)
        server.should_exit = True
        thread.join(timeout=30)


@needs_browser
def test_the_page_draws_the_swap_pool_and_whose_blocks_are_there(browser):
    """A snapshot of a real engine with a request swapped out, drawn by the page."""
    from selenium.webdriver.support.ui import WebDriverWait

    llm = swapped_engine()
    snap = snapshot(llm)
    server, thread, url = serve(LLM("tiny", num_gpu_blocks=16, max_model_len=64))
    try:
        browser.get(f"{url}/?every=600000")  # draw the snapshot given below, not the server's
        WebDriverWait(browser, 30).until(lambda b: "blocks in use" in b.execute_script(
            "return document.getElementById('summary').textContent"))
        drawn = browser.execute_script("""draw(arguments[0]);
            return {title: document.getElementById('cpu-title').textContent,
                    legend: document.getElementById('cpu-legend').textContent,
                    owners: [...document.querySelectorAll('#cpu-blocks .block')].map(c => c.dataset.owner),
                    queue: [...document.querySelectorAll('#queues tr')].map(tr => tr.textContent)};""", snap)
        cpu = snap["cpu"]
        used = cpu["num_blocks"] - cpu["free_blocks"]
        assert f"{used} of {cpu['num_blocks']}" in drawn["title"]
        assert "c (" in drawn["legend"] and len(drawn["owners"]) == cpu["num_blocks"]
        assert [i for i, o in enumerate(drawn["owners"]) if o] == sorted(map(int, cpu["blocks"]))
        assert {o for o in drawn["owners"] if o} == {"c"}
        assert any("swapped" in row and row.startswith("c") for row in drawn["queue"])
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_the_load_generator_talks_to_the_loopback_only_and_keeps_the_full_results(monkeypatch):
    """bench/serving_load.py refuses any other host; only its full run writes bench/results."""
    import importlib
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "bench" / "serving_load.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as a script, it imports bench/'s own modules
    spec = importlib.util.spec_from_file_location("serving_load", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000"):
        assert bench.loopback_url(url).startswith("http://")
    for url in ("http://10.0.0.1:8000", "http://example.com", "https://127.0.0.1:8000", "http://0.0.0.0:8000",
                "http://127.0.0.1.example.com:80"):
        with pytest.raises(ValueError):
            bench.loopback_url(url)
    def no_server(*args):
        raise AssertionError("a server was started")

    monkeypatch.setattr(bench, "start_server", no_server)
    monkeypatch.setattr(bench.httpx, "AsyncClient", no_server)
    monkeypatch.setattr("sys.argv", ["serving_load.py", "--url", "http://example.com:8000"])
    with pytest.raises(SystemExit):  # refused before any server starts or any request is sent
        bench.main()
    where = {tuple(a): bench.output_dir(bench.build_parser().parse_args(a))
             for a in ([], ["--quick"], ["--streams", "2"], ["--quick", "--streams", "2"])}
    results = importlib.import_module("harness").RESULTS  # bench/results
    assert where[()] == results
    assert all(d != results and results in d.parents for a, d in where.items() if a)


def test_snapshot_of_a_hybrid_cache_lists_the_blocks_each_request_holds_in_every_group(tmp_path_factory):
    """Stage 15's manager under the page: each request's blocks, every group's, the null block left out."""
    from helpers_checkpoints import random_prompts, save_random_checkpoints, sliding_window_architectures

    mixed = sliding_window_architectures(8, num_layers=4, full_layers=2)["mixed"]
    llm = _LLM(save_random_checkpoints(tmp_path_factory, {"mixed": mixed})["mixed"], block_size=4,
              num_gpu_blocks=64, max_model_len=64)
    for i, prompt in enumerate(random_prompts(0, (30, 9))):
        llm.engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, ignore_eos=True))
    run(llm, 3)  # past the window: the long request's sliding group has given blocks back
    snap = snapshot(llm)
    manager = llm.scheduler.kv_cache_manager
    assert snap["cpu"] is None and [r["id"] for r in snap["running"]] == ["0", "1"]
    for request in snap["running"]:
        (seq,) = request["seqs"]
        full, sliding = manager.coordinator.block_ids(llm.engine.requests[request["id"]].seqs[0].seq_id)
        real = [b for b in sliding if b != manager.coordinator.null_block]
        assert seq["where"] == "gpu" and seq["block_table"] == full + real
    assert manager.coordinator.null_block in manager.coordinator.block_ids(llm.engine.requests["0"].seqs[0].seq_id)[1]
    assert len(snap["blocks"]) == snap["num_blocks"] - snap["free_blocks"] == sum(
        len(r["seqs"][0]["block_table"]) for r in snap["running"])
