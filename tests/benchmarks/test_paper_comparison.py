"""The grid's tables beside the paper's: the paper's numbers read from LaTeX, ours as mean ± std, the docs page kept
in step with the committed results."""

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.paper_comparison import (
    ARMS,
    BAYESIAN,
    CLAIMS,
    EDL_ACCURACY,
    EDL_FAMILY,
    GRID_COLUMNS,
    Claim,
    claim_cell,
    claim_diffs,
    claims_table,
    default_paper,
    fill,
    grid_sections,
    main,
    parse_paper,
    sections,
    sigma_head_table,
)

REPO = Path(__file__).resolve().parents[2]


def calibration_table(label: str, sciq: dict[str, tuple[str, str, str]]) -> str:
    """A table in the paper's layout: Acc/ECE/NLL blocks, six dataset columns, SciQ the fifth."""
    lines = [r"\begin{table}[t]", r"\begin{tabular}{c| c | c c c c c c}",
             r"         Metrics & Method & ARC-C & ARC-E & OBQA & CSQA & SciQ & RACE\\"]
    for i, metric in enumerate(("Acc", "ECE", "NLL")):
        lines.append(rf"         \multirow{{9}}{{*}}{{{metric} $\uparrow$}}")
        for method, values in sciq.items():
            cells = [r"\ms{1.00}{0.10}"] * 4 + [rf"\ms{{{values[i]}}}{{0.20}}[b]", r"\ms{2.00}{0.10}"]
            lines.append(rf"            & {method} & " + " & ".join(cells) + r" \\")
    return "\n".join(lines + [r"\end{tabular}", rf"\label{{{label}}}", r"\end{table}"])


TEX = "\n".join([
    calibration_table("tab:id_llama2_7b", {"MAP": ("91.30", "6.85", "0.38"), "IB-EDL": ("91.10", "5.01", "0.29")}),
    calibration_table("tab:id_llama3_8b", {"MAP": ("93.37", "5.74", "0.36")}),
    calibration_table("tab:full_noisy_llama2_7b", {"MAP": ("88.63", "19.05", "0.50")}),
    calibration_table("tab:full_noisy_llama3_8b", {"IB-EDL": ("93.46", "25.00", "0.46")}),
    r"""\begin{table}[t]
        \multirow{3}{*}{Model} & \multirow{3}{*}{Method} & \multicolumn{2}{c|}{OBQA $\rightarrow$ ARC-C} & \multicolumn{2}{c}{OBQA $\rightarrow$ CSQA} \\
        \multirow{9}{*}{Llama2-7B} & MAP    & \ms{76.07}{0.71} & $-$ & \ms{72.45}{0.20} & $-$ \\
        & IB-EDL & \ms{87.47}{0.91}[b] & \ms{88.34}{3.07}[b] & \ms{86.38}{0.53}[b] & \ms{79.79}{4.64}[b] \\
        \multirow{9}{*}{Llama3-8B} & IB-EDL & \ms{88.85}{0.96}[b] & \ms{92.58}{0.37}[b] & \ms{89.16}{1.01}[b] & \ms{85.45}{0.55}[b] \\
    \label{tab:ood_llama2_7b_llama3_8b}
\end{table}""",  # noqa: E501 - the paper's rows, as its source writes them
    r"""\begin{table}[t]
        Method & Test Samples/s $\uparrow$ & Training Samples/s $\uparrow$ & Memory (GB) at Training$\downarrow$ \\
        MAP & \ms{69.55}{2.86} & \ms{26.57}{1.96} & \ms{21.21}{0.35} \\
        MCD (10 forwards) & \ms{9.79}{1.21} & - & - \\
        IB-EDL & \ms{68.08}{1.75} & \ms{26.41}{1.04} & \ms{21.88}{0.66} \\
    \label{tab:train_test_consumption}
\end{table}"""])  # noqa: E501 - the paper's rows, as its source writes them


def test_the_papers_sciq_column_and_ood_table_are_read():
    paper = parse_paper(TEX)
    assert paper["id"]["Llama2-7B"]["map"] == {"accuracy": (91.30, 0.20), "ece": (6.85, 0.20), "nll": (0.38, 0.20)}
    assert paper["id"]["Llama2-7B"]["ib_edl"]["ece"] == (5.01, 0.20)
    assert paper["noise"]["Llama3-8B"] == {"ib_edl": {"accuracy": (93.46, 0.2), "ece": (25.0, 0.2), "nll": (0.46, 0.2)}}
    assert paper["ood"]["Llama2-7B"]["map"] == {"ARC-C": {"mp": (76.07, 0.71), "um": None},
                                               "CSQA": {"mp": (72.45, 0.20), "um": None}}
    assert paper["ood"]["Llama3-8B"]["ib_edl"]["CSQA"] == {"mp": (89.16, 1.01), "um": (85.45, 0.55)}
    assert paper["cost"]["mc_dropout"] == {"test_samples_per_s": (9.79, 1.21), "train_samples_per_s": None,
                                           "train_memory_gb": None}
    assert paper["cost"]["ib_edl"]["train_memory_gb"] == (21.88, 0.66)


def test_a_missing_table_is_named():
    with pytest.raises(ValueError, match=r"no table labelled \['tab:id_llama3_8b'\]"):
        parse_paper(TEX.replace("tab:id_llama3_8b", "tab:something_else"))


def record(kind: str, method: str, seed: int, **metrics) -> dict:
    return {"kind": kind, "method": method, "seed": seed, "dataset": "sciq", "metrics": metrics,
            "label_noise": 0.3 if kind == "noise" else 0.0,
            "metrics_without_posthoc": metrics.pop("without", None)}


RESULTS = [
    record("id", "map", 0, accuracy=0.80, ece=0.05, nll=0.4, aurc=0.02, **{"acc@80": 0.9}),
    record("id", "map", 1, accuracy=0.90, ece=0.07, nll=0.4, aurc=0.04, **{"acc@80": 0.9}),
    record("id", "ib_edl", 0, accuracy=0.85, ece=0.10, nll=0.5, aurc=0.03, **{"acc@80": 0.95},
           without={"accuracy": 0.84, "ece": 0.12, "nll": 0.6, "aurc": 0.03, "acc@80": 0.93}),
    record("id", "ib_edl", 1, accuracy=0.86, ece=0.11, nll=0.5, aurc=0.03, **{"acc@80": 0.95}),
    record("ood", "map", 0, accuracy=0.8, **{"ood/obqa/auroc_mp": 0.90, "ood/obqa/auroc_mp_matched": 0.91}),
    record("ood", "ib_edl", 0, accuracy=0.85, **{"ood/obqa/auroc_mp": 0.80, "ood/obqa/auroc_um": 0.95,
                                                 "ood/obqa/auroc_mp_matched": 0.82, "ood/obqa/auroc_um_matched": 0.95}),
    record("noise", "map", 0, accuracy=0.70, ece=0.2, nll=0.7),
]


def test_ours_are_mean_and_population_std_over_seeds_beside_the_paper():
    blocks = sections(RESULTS, parse_paper(TEX))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in blocks["id"].splitlines()[2:]}
    # MAP: accuracy 80 and 90 -> 85.00 ± 5.00; AURC 0.02 and 0.04 -> 0.030 ± 0.010; no Llama3 IB-EDL in this paper
    assert rows["MAP"][1:6] == ["0,1", "85.00 ± 5.00", "6.00 ± 1.00", "0.40 ± 0.00", "0.030 ± 0.010"]
    assert rows["MAP"][7:] == ["91.30 / 6.85 / 0.38", "93.37 / 5.74 / 0.36 |"]
    # IB-EDL as the paper runs it (ζ = 0: the seed that measured it) carries the paper's numbers; the row with the
    # post-hoc ζ comes after it, labelled, without them
    assert rows["IB-EDL (ζ = 0)"][1:4] == ["0", "84.00", "12.00"]
    assert rows["IB-EDL (ζ = 0)"][-2:] == ["91.10 / 5.01 / 0.29", " |"]
    assert rows["IB-EDL + post-hoc ζ"][-2:] == ["", " |"]
    assert list(rows).index("IB-EDL (ζ = 0)") + 1 == list(rows).index("IB-EDL + post-hoc ζ")
    ood = {line.split(" | ")[0].strip("| "): line for line in blocks["ood"].splitlines()[2:4]}
    assert ood["MAP"].endswith("| 0 | 90.0 / – |") and ood["IB-EDL"].endswith("| 0 | 80.0 / 95.0 |")
    assert "no mean AUROC above moves by more than 2.0 points" in blocks["ood"]
    assert blocks["noise"].splitlines()[2] == "| MAP | 0 | 70.00 | 20.00 | 0.70 | 88.63 / 19.05 / 0.50 |  |"
    assert "| IB-EDL | 87.5 / 88.3 | 86.4 / 79.8 | 88.8 / 92.6 | 89.2 / 85.5 |" in blocks["paper-ood"]


def test_the_sigma_ablation_sits_beside_the_learned_sigma():
    frozen = [
        record("id", "ib_edl", 0, accuracy=0.80, ece=0.20, nll=0.6),
        record("id", "ib_edl", 1, accuracy=0.82, ece=0.22, nll=0.6),
        record("ood", "ib_edl", 0, **{"ood/obqa/auroc_mp": 0.70, "ood/obqa/auroc_um": 0.80,
                                      "ood/arc_easy/auroc_mp": 0.74, "ood/arc_easy/auroc_um": 0.90}),
    ]
    sigma = sections(RESULTS, parse_paper(TEX), ablation=frozen)["sigma"].splitlines()
    rows = {line.split(" | ")[0].strip("| "): line for line in sigma if line.startswith("| learned") or
            line.startswith("| σ frozen")}
    # learned: the grid's IB-EDL (accuracy 85 and 86, ECE 10 and 11, NLL 0.5; ood seed 0 only: MP 80, UM 95)
    assert rows["learned σ (the grid)"] == ("| learned σ (the grid) | 0,1 | 85.50 ± 0.50 | 10.50 ± 0.50 | "
                                            "0.500 ± 0.000 | 80.0 | 95.0 |")
    # frozen: the mean over its two streams, per seed (MP (70 + 74) / 2, UM (80 + 90) / 2)
    assert rows["σ frozen (the ablation)"] == ("| σ frozen (the ablation) | 0,1 | 81.00 ± 1.00 | 21.00 ± 1.00 | "
                                               "0.600 ± 0.000 | 72.0 | 85.0 |")
    assert "σ frozen" not in sections(RESULTS, parse_paper(TEX))["sigma"]


def head_arm(sigma: float, rho: float, auroc_sigma: float, auroc_um: float) -> list[dict]:
    """Two seeds of an IB-EDL arm: ζ = 0 metrics (``without``) carry the values, the served ones something else."""
    runs = []
    for seed, shift in ((0, 0.0), (1, 0.02)):
        served = {"accuracy": 0.5, "nll": 9.0, "sigma/median": 9.0, "sigma/cv": 9.0, "sigma/spearman_inv_u": 0.0}
        zeta0 = {"accuracy": 0.8, "nll": 0.4 + shift, "sigma/median": sigma + shift, "sigma/cv": 0.3,
                 "sigma/spearman_inv_u": rho}
        runs.append(record("id", "ib_edl", seed, **served, without=zeta0))
        stream = {"ood/obqa/sigma_spearman_inv_u": rho - shift, "ood/obqa/auroc_sigma": auroc_sigma + shift,
                  "ood/obqa/auroc_um": auroc_um}
        runs.append(record("ood", "ib_edl", seed, **{k: 0.0 for k in stream}, without=stream))
    return runs


def test_the_sigma_head_table_puts_both_arms_side_by_side_at_zeta_0():
    arms = [("trained", head_arm(2.0, 0.99, 0.90, 0.91)), ("frozen", head_arm(1.0, 0.95, 0.80, 0.81))]
    lines = sigma_head_table(arms)
    # in distribution: σ median (2.00 + 2.02) / 2 = 2.010 ± 0.010, NLL 0.410 ± 0.010, read at ζ = 0, not served
    assert lines[2] == "| trained | 0,1 | 2.010 ± 0.010 | 0.300 ± 0.000 | 0.410 ± 0.010 | 0.990 ± 0.000 |"
    assert lines[3] == "| frozen | 0,1 | 1.010 ± 0.010 | 0.300 ± 0.000 | 0.410 ± 0.010 | 0.950 ± 0.000 |"
    # per stream, each measure with the arms adjacent: ρ 0.99 and 0.97 -> 0.980 ± 0.010
    assert lines[5].startswith("| shifted stream | ρ(σ, 1/u), trained | ρ(σ, 1/u), frozen | AUROC σ, trained |")
    assert lines[7] == ("| OBQA | 0.980 ± 0.010 | 0.940 ± 0.010 | 0.910 ± 0.010 | 0.810 ± 0.010 | 0.910 ± 0.000 | "
                        "0.810 ± 0.000 |")


def test_the_sigma_head_block_names_an_arm_without_results():
    frozen = head_arm(1.0, 0.95, 0.80, 0.81)
    block = sections(RESULTS, parse_paper(TEX), heads=[("trained", None), ("frozen", frozen)])["sigma-head"]
    assert "| frozen | 0,1 |" in block and "| trained |" not in block
    assert block.endswith("No results yet for the trained arm (its config: benchmarks/sciq_sigma_trained.yaml).")
    assert "sigma-head" not in sections(RESULTS, parse_paper(TEX))


def test_training_start_and_end_come_from_the_runs_records():
    results = [dict(r) for r in RESULTS]
    start = {"accuracy": 0.5, "mean_confidence": 0.6, "ece": 0.2, "nll": 1.0}
    for r in results:
        r["training"] = {"validation_start": start, "steps": [40], "best_steps": [20], "budget_steps": 100,
                         "stopped_by": ["patience"],
                         "validation_end": {**start, "accuracy": r["metrics"]["accuracy"], "nll": 0.4}}
    rows = sections(results, parse_paper(TEX))["training"].splitlines()
    same = "0.600 → 0.600 | 20.0 → 20.0 | 1.000 → 0.400 | 40 (20) of 100"
    assert f"| MAP | clean | 50.0 → 85.0 | {same} | 2 of 2 |" in rows  # the mean of seeds 0 and 1's ends
    assert f"| MAP | noise | 50.0 → 70.0 | {same} | 1 of 1 |" in rows


EFFICIENCY = {"methods": {
    "map": {"train_samples_per_s": 4.0, "test_samples_per_s": 10.0, "train_peak_rss_mib": 800.0,
            "eval_peak_rss_mib": 700.0, "train_seconds": 24.0, "reuses_training_of": None},
    "mc_dropout": {"train_samples_per_s": 4.0, "test_samples_per_s": 1.0, "train_peak_rss_mib": 800.0,
                   "eval_peak_rss_mib": 710.0, "train_seconds": 24.0, "reuses_training_of": "map"},
    "ib_edl": {"train_samples_per_s": 3.0, "test_samples_per_s": 9.0, "train_peak_rss_mib": 880.0,
               "eval_peak_rss_mib": None, "train_seconds": 32.0, "reuses_training_of": None},
}}


def test_cost_is_ratios_to_map_beside_the_papers_ratios():
    rows = {line.split(" | ")[0].strip("| "): line for line in
            sections(RESULTS, parse_paper(TEX), EFFICIENCY)["cost"].splitlines()[2:]}
    # ours: 3/4 = 0.75x, 9/10 = 0.90x, 880/800 = 1.10x, no test memory; the paper's: 68.08/69.55, 26.41/26.57,
    # 21.88/21.21
    assert rows["IB-EDL"] == ("| IB-EDL | 0.75x (3.00 q/s) | 0.90x (9.00 q/s) | 1.10x (880 MiB) | – | 0.98x | 0.99x | "
                              "1.03x |")
    # MC-Dropout reuses MAP's training run: its train columns say so, and the paper has no train numbers for it
    assert rows["MCD"] == "| MCD | MAP's | 0.10x (1.00 q/s) | MAP's | 1.01x (710 MiB) | 0.14x | – | – |"
    assert "cost" not in sections(RESULTS, parse_paper(TEX))


def test_fill_replaces_only_between_the_markers():
    page = ("intro\n<!-- begin generated: paper-comparison id -->\nold\n<!-- end generated: paper-comparison id -->\n"
            "prose\n")
    assert fill(page, {"id": "new\ntable"}) == page.replace("old", "new\ntable")
    with pytest.raises(ValueError, match="no '<!-- begin generated: paper-comparison ood -->'"):
        fill(page, {"ood": "x"})


@pytest.mark.skipif(not default_paper().is_file(), reason=f"the paper's source {default_paper()} is not here")
def test_the_docs_page_matches_the_committed_results(tmp_path, capsys):
    results, docs = REPO / "benchmarks/results/sciq_grid.json", REPO / "docs/results.md"
    efficiency = ["--efficiency", str(REPO / "benchmarks/results/method_efficiency.json"),
                  "--ablation", str(REPO / "benchmarks/results/sciq_sigma_ablation.json"),
                  "--sigma-heads", *(str(REPO / f"benchmarks/results/sciq_sigma_{arm}.json")
                                     for arm in ("trained", "frozen"))]
    assert main(["--results", str(results), "--docs", str(docs), "--check", *efficiency]) == 0
    # a results file that changed makes the check fail, and a run without --check brings the page back in step
    changed = json.loads(results.read_text())
    changed[0]["metrics"]["accuracy"] = 0.5
    (tmp_path / "r.json").write_text(json.dumps(changed))
    shutil.copy(docs, tmp_path / "results.md")
    args = ["--results", str(tmp_path / "r.json"), "--docs", str(tmp_path / "results.md"), *efficiency]
    assert main(args + ["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(args) == 0 and main(args + ["--check"]) == 0
    assert (tmp_path / "results.md").read_text() != docs.read_text()


def test_bad_input_is_an_error_message(tmp_path, capsys):
    assert main(["--results", str(tmp_path / "missing.json"), "--paper", str(tmp_path / "p.tex")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_the_paper_protocol_grid_fills_its_own_blocks_and_states_the_starts_overlap():
    results = [dict(r) for r in RESULTS]
    for r in results:
        r["training"] = {"start_overlap": {"start": "artifacts/map", "questions": 1000, "seen_by_start": 0,
                                           "disjoint_from": "artifacts/map"}}
    blocks = grid_sections(results, parse_paper(TEX), "sciq_grid_paper", {"sciq_grid": RESULTS})
    assert set(blocks) == {"sciq_grid_paper/training", "sciq_grid_paper/id", "sciq_grid_paper/ood",
                           "sciq_grid_paper/noise", "sciq_grid_paper/claims"}
    claims = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in
              blocks["sciq_grid_paper/claims"].splitlines()[2:2 + len(CLAIMS)]}
    # the first protocol's column reads the first grid (RESULTS), the second this grid's runs (seed 1 changed here)
    ece = claims["IB-EDL is better calibrated than MAP (ECE, points)"]
    # ζ-free 12% against MAP's 5%
    assert ece[2] == "not reproduced: +7.00 (0 of 1 seed)" and ece[3] == "not reproduced: +7.00 (0 of 1 seed) |"
    better = [*results[:2], record("id", "ib_edl", 0, accuracy=0.85, ece=0.10, nll=0.5,
                                   without={"accuracy": 0.8, "ece": 0.03}), *results[3:]]
    changed = grid_sections(better, parse_paper(TEX), "sciq_grid_paper",
                            {"sciq_grid": RESULTS})["sciq_grid_paper/claims"]
    assert "| not reproduced: +7.00 (0 of 1 seed) | direction only: -2.00 (1 of 1 seed) |" in changed
    assert blocks["sciq_grid_paper/id"] == sections(results, parse_paper(TEX))["id"]  # the first grid's tables
    assert blocks["sciq_grid_paper/training"].endswith(
        "Training questions the start (artifacts/map) had drawn for its own training: 0 of 1000 in each of the "
        f"{len(results)} cells that recorded it (training.start_overlap).")


def test_a_grid_without_results_says_so_and_its_check_passes_on_a_page_that_says_so(tmp_path, capsys):
    empty = grid_sections([], parse_paper(TEX), "sciq_grid_paper", {"sciq_grid": RESULTS})
    claims = empty.pop("sciq_grid_paper/claims")  # the first protocol's column still reads the first grid
    assert all(body.startswith("No results yet: the grid (benchmarks/sciq_grid_paper.yaml) has no finished cell")
               for body in empty.values()) and len(empty) == 4
    columns = [(GRID_COLUMNS["sciq_grid"], RESULTS, None), (GRID_COLUMNS["sciq_grid_paper"], [], None)]
    assert claims.startswith("\n".join(claims_table(columns, parse_paper(TEX))))
    assert "| not reproduced: +7.00 (0 of 1 seed) | – |" in claims  # no second-protocol runs yet
    empty["sciq_grid_paper/claims"] = claims
    (tmp_path / "p.tex").write_text(TEX)
    (tmp_path / "first.json").write_text(json.dumps(RESULTS))
    docs = tmp_path / "results.md"
    docs.write_text("".join(f"<!-- begin generated: paper-comparison {name} -->\nold\n"
                            f"<!-- end generated: paper-comparison {name} -->\n" for name in empty))
    args = ["--grid", "sciq_grid_paper", "--results", str(tmp_path / "none.json"), "--paper", str(tmp_path / "p.tex"),
            "--docs", str(docs), "--first-results", str(tmp_path / "first.json")]
    assert main([*args, "--check"]) == 1
    assert (f"out of date with {tmp_path / 'none.json'} and {tmp_path / 'first.json'} (no results yet): run python "
            "-m benchmarks.paper_comparison --grid sciq_grid_paper") in capsys.readouterr().err
    assert main(args) == 0 and main([*args, "--check"]) == 0
    assert "matches" in capsys.readouterr().out and "No results yet" in docs.read_text()
    # the first grid's check does not read the second grid's blocks, nor needs them
    assert "sciq_grid_paper" not in "".join(sections(RESULTS, parse_paper(TEX)))


@pytest.mark.skipif(not default_paper().is_file(), reason=f"the paper's source {default_paper()} is not here")
def test_the_docs_page_matches_the_paper_grids_committed_results(capsys):
    results = REPO / "benchmarks/results/sciq_grid_paper.json"
    assert main(["--grid", "sciq_grid_paper", "--results", str(results), "--docs", str(REPO / "docs/results.md"),
                 "--check"]) == 0


def test_each_claim_is_a_paired_difference_per_seed_beside_the_papers_own():
    first = [
        record("id", "map", 0, accuracy=0.80, ece=0.05, nll=0.40),
        record("id", "map", 1, accuracy=0.80, ece=0.06, nll=0.40),
        record("id", "map", 2, accuracy=0.80, ece=0.07, nll=0.40),
        # IB-EDL with its post-hoc zeta is better than MAP on every seed; at zeta 0 (the paper's) on two of three
        *(record("id", "ib_edl", seed, accuracy=0.85, ece=0.01, nll=0.30,
                 without={"accuracy": acc, "ece": ece, "nll": 0.45}) for seed, acc, ece in
          ((0, 0.805, 0.04), (1, 0.78, 0.08), (2, 0.80, 0.06))),
        record("ood", "map", 0, **{"ood/obqa/auroc_mp": 0.80, "ood/arc_easy/auroc_mp": 0.84}),
        record("ood", "ib_edl", 0, **{"ood/obqa/auroc_um": 0.99, "ood/arc_easy/auroc_um": 0.99},
               without={"ood/obqa/auroc_um": 0.90, "ood/arc_easy/auroc_um": 0.86}),
    ]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in
            claims_table([("first", first, None), ("second", [], None)], parse_paper(TEX))[2:]}
    assert len(rows) == len(CLAIMS)
    # ECE differences at zeta 0: -1, +2, -1 points -> mean 0, population std sqrt(2); the claimed way on seeds 0, 2
    ece = rows["IB-EDL is better calibrated than MAP (ECE, points)"]
    # Llama3's IB-EDL is not in this TEX; a mean of 0 is not the claimed side
    assert ece == ["Llama2-7B -1.84", "not reproduced: +0.00 ± 1.41 (2 of 3 seeds)", "– |"]
    # accuracy: +0.5, -2, 0 points; no more than 1 point below on two seeds
    assert rows["IB-EDL is as accurate as MAP (Acc, points; holds when at most 1 point below)"][1] == (
        "direction only: -0.50 ± 1.08 (2 of 3 seeds)")  # the mean within the 1-point tolerance
    assert rows["IB-EDL has a lower NLL than MAP"][1] == "not reproduced: +0.050 ± 0.000 (0 of 3 seeds)"
    # OOD: IB-EDL's 1/u at zeta 0 averaged over the streams ((90 + 86) / 2) against MAP's max probability (82);
    # the paper's Table 3 the same way (TEX: IB-EDL's UM over its two targets against MAP's MP)
    ood = rows["IB-EDL's 1/u flags shifted questions better than MAP's max probability (mean AUROC over the "
               "streams, points)"]
    assert ood[1:] == ["direction only: +6.00 (1 of 1 seed)", "– |"]
    assert ood[0] == f"Llama2-7B {(88.34 + 79.79) / 2 - (76.07 + 72.45) / 2:+.2f}"
    # no pair in the paper's noise tables of this TEX, no MAP+TS anywhere in the paper, no noise runs here
    noise = rows["Under 30% label noise IB-EDL is more accurate than MAP (Acc, points)"]
    assert noise == ["", "–", "– |"]
    assert rows["IB-EDL is better calibrated than MAP with temperature scaling (ECE, points; not the paper's "
                "comparison)"][0] == ""


def test_a_claim_against_several_rows_takes_the_best_on_seeds_that_have_them_all():
    edl = next(c for c in CLAIMS if c.b == EDL_FAMILY and c.kind == "noise")
    noise = [record("noise", "ib_edl", seed, ece=0.0, without={"ece": ece}) for seed, ece in ((0, 0.10), (1, 0.10))]
    noise += [record("noise", m, 0, ece=ece) for m, ece in (("edl", 0.30), ("vid", 0.08), ("i_edl", 0.2),
                                                            ("r_edl", 0.4))]
    noise += [record("noise", m, 1, ece=0.3) for m in ("edl", "vid", "i_edl")]  # seed 1 has no R-EDL: left out
    assert claim_diffs(edl, noise) == pytest.approx([2.0])  # 10% against VID's 8%, the best of the four
    assert claim_cell(edl, noise) == "not reproduced: +2.00 (0 of 1 seed)"


def test_a_higher_is_better_claim_against_several_rows_takes_the_highest():
    acc = next(c for c in CLAIMS if c.b == EDL_ACCURACY)
    assert acc.kind == "noise" and acc.better == "higher"
    noise = [record("noise", "ib_edl", 0, accuracy=0.0, without={"accuracy": 0.79})]
    noise += [record("noise", m, 0, accuracy=a) for m, a in (("edl", 0.80), ("vid", 0.75), ("i_edl", 0.82),
                                                             ("r_edl", 0.86))]
    assert claim_diffs(acc, noise) == pytest.approx([-7.0])  # 79% against R-EDL's 86%, the most accurate
    assert claim_cell(acc, noise) == "not reproduced: -7.00 (0 of 1 seed)"


def test_the_bayesian_claim_takes_the_better_of_mc_dropout_and_laplace_on_each_seed():
    bayes = next(c for c in CLAIMS if c.b == BAYESIAN)
    runs = [record("id", "ib_edl", seed, ece=0.0, without={"ece": 0.05}) for seed in (0, 1, 2)]
    runs += [record("id", "mc_dropout", 0, ece=0.09), record("id", "laplace", 0, ece=0.07),  # Laplace the better
             record("id", "mc_dropout", 1, ece=0.03), record("id", "laplace", 1, ece=0.06),  # MC-Dropout the better
             record("id", "mc_dropout", 2, ece=0.01)]  # seed 2 has no Laplace: left out
    assert claim_diffs(bayes, runs) == pytest.approx([-2.0, 2.0])
    assert claim_cell(bayes, runs) == "not reproduced: +0.00 ± 2.00 (1 of 2 seeds)"


def test_claims_are_checked_and_no_worse_survives_float_error():
    with pytest.raises(ValueError, match="better must be one of .* got 'smaller'"):
        Claim("x", "id", ("map", "ece"), (("map", "ece"),), 100, "smaller")
    with pytest.raises(ValueError, match="kind must be id, ood or noise, got 'test'"):
        Claim("x", "test", ("map", "ece"), (("map", "ece"),), 100, "lower")
    with pytest.raises(ValueError, match="no_worse claim needs a tolerance > 0"):
        Claim("x", "id", ("map", "ece"), (("map", "ece"),), 100, "no_worse")
    par = Claim("x", "id", ("ib_edl", "accuracy"), (("map", "accuracy"),), 100, "no_worse", 1.0)
    runs = [record("id", "ib_edl", 0, accuracy=0.86), record("id", "map", 0, accuracy=0.87)]
    # (0.86 - 0.87) x 100 is -1.0000000000000009
    assert claim_cell(par, runs) == "direction only: -1.00 (1 of 1 seed)"
    more = [record("id", "ib_edl", 0, accuracy=0.884), record("id", "map", 0, accuracy=0.87)]
    assert claim_cell(par, more) == "direction only: +1.40 (1 of 1 seed)"  # more accurate: no failure of it


def test_ood_claims_average_the_streams_both_rows_have():
    ood = next(c for c in CLAIMS if c.kind == "ood")
    runs = [record("ood", "map", 0, **{"ood/obqa/auroc_mp": 0.80, "ood/race/auroc_mp": 0.50}),
            record("ood", "ib_edl", 0, without={"ood/obqa/auroc_um": 0.90, "ood/arc_easy/auroc_um": 0.10})]
    assert claim_diffs(ood, runs) == pytest.approx([10.0])  # OBQA alone: 90 against 80


def intervals_for(claim_text: str, entry: dict, over: dict | None = None) -> dict:
    return {"claims": {claim_text: entry}, "map_over_confidence": over or {}}


def test_the_shared_rate_grid_gives_each_claim_its_paired_interval_and_shows_the_regime():
    ece_claim = "IB-EDL is better calibrated than MAP (ECE, points)"
    entry = {"seeds": 2, "pooled": {"difference": -1.234, "ci95": [-2.0, -0.5], "verdict": "holds"},
             "per_seed": {"0": {}, "1": {}}, "held_on": 2, "direction_on": 2,
             "over_seeds": {"difference": -1.234, "ci95": [-1.9, -0.6], "verdict": "holds", "against": False}}
    over = {"0": {"accuracy": 0.85, "mean_confidence": 0.93, "over_confidence": {"value": 0.08, "ci95": [0.06, 0.1]},
                  "ece": {"value": 0.081, "ci95": [0.065, 0.1]}}}
    results = [dict(r) for r in RESULTS]
    from ibedl.training.experiments.benchmark import training_summary

    start = {"accuracy": 0.87, "mean_confidence": 0.894, "ece": 0.074, "brier": 0.18}
    run = {"validation_start": {**start, "nll": 0.353}, "validation_end": {**start, "nll": 0.408}, "steps": 375,
           "budget_steps": 375}
    trajectory = [{"member": 0, "step": 75, "nll": 0.352}, {"member": 0, "step": 150, "nll": 0.414}]
    results[0] = {**results[0], "training": training_summary({"training": {"run": run}}, trajectory)}
    earlier = {"sciq_grid": RESULTS, "sciq_grid_paper": RESULTS}
    check = [record("id", "map", 0, accuracy=0.84, ece=0.09, mean_confidence=0.95)]
    blocks = grid_sections(results, parse_paper(TEX), "sciq_grid_shared_lr", earlier,
                           intervals_for(ece_claim, entry, over), {"3e-3, 3 epochs": (check, None)})
    assert set(blocks) == {f"sciq_grid_shared_lr/{b}" for b in ("training", "id", "ood", "noise", "claims", "regime")}
    claims = blocks["sciq_grid_shared_lr/claims"]
    header = claims.splitlines()[0]
    assert header.endswith("| early stopping, per-family rates | fixed budget, per-family rates | fixed budget, one "
                           "rate for all (pooled 95% interval; over seeds) |")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in claims.splitlines()[2:2 + len(CLAIMS)]}
    assert rows[ece_claim][-1] == ("reproduced: -1.23 [-2.00, -0.50]; over seeds [-1.90, -0.60]; interval holds on 2 "
                                   "of 2, direction on 2 of 2 seeds |")
    assert rows["IB-EDL has a lower NLL than MAP"][-1] == "– |"  # no interval computed for it
    regime = blocks["sciq_grid_shared_lr/regime"].splitlines()
    assert regime[2] == ("| 1e-3, 10 epochs | 0 | 0.353 → 0.352 (step 75) → 0.408 | 80.0% | 0.930 | "
                         "+8.0 [+6.0, +10.0] | 8.1 [6.5, 10.0] |")
    assert regime[4] == "| 3e-3, 3 epochs | 0 | – | 84.0% | 0.950 | – | 9.0 |"  # a check without kept predictions
    assert regime[-1].endswith("early stopping, per-family rates 6.0 ± 1.0% (2 seeds); fixed budget, per-family "
                               "rates 6.0 ± 1.0% (2 seeds).")


def test_without_intervals_the_grid_keeps_the_per_seed_cells_and_its_regime_block_says_so():
    blocks = grid_sections(RESULTS, parse_paper(TEX), "sciq_grid_shared_lr", {"sciq_grid": RESULTS})
    assert blocks["sciq_grid_shared_lr/regime"].endswith(
        "No intervals yet: python -m benchmarks.grid_predictions --grid sciq_grid_shared_lr, then python -m "
        "benchmarks.grid_intervals --grid sciq_grid_shared_lr.")
    assert "| 1e-3, 10 epochs | 0 | – | 80.0% | – | – | 5.0 |" in blocks["sciq_grid_shared_lr/regime"]
    assert ("| not reproduced: +7.00 (0 of 1 seed) | not reproduced: +7.00 (0 of 1 seed) |"
            in blocks["sciq_grid_shared_lr/claims"])
    assert "sciq_grid_paper/regime" not in grid_sections(RESULTS, parse_paper(TEX), "sciq_grid_paper",
                                                         {"sciq_grid": RESULTS})


def test_an_arm_beside_the_grid_is_a_claims_column_of_its_own_or_says_it_has_not_run():
    ece_claim = "IB-EDL is better calibrated than MAP (ECE, points)"
    entry = {"seeds": 1, "pooled": {"difference": -2.5, "ci95": [-3.0, -2.0], "verdict": "holds"},
             "per_seed": {"0": {}}, "held_on": 1, "direction_on": 1}
    (label,) = ARMS["sciq_grid_shared_lr"].values()
    (name,) = ARMS["sciq_grid_shared_lr"]
    ran = grid_sections(RESULTS, parse_paper(TEX), "sciq_grid_shared_lr", {"sciq_grid": RESULTS},
                        intervals_for(ece_claim, entry), arms={label: intervals_for(ece_claim, entry)})
    claims = ran["sciq_grid_shared_lr/claims"].splitlines()
    assert claims[0].endswith(f"| fixed budget, one rate for all (pooled 95% interval; over seeds) | {label} "
                              "(pooled 95% interval; over seeds) |")
    row = next(line for line in claims if line.startswith(f"| {ece_claim} |"))
    # one seed shows no seed spread: at most the direction, however narrow its interval
    assert row.endswith("| direction only: -2.50 [-3.00, -2.00]; interval holds on 1 of 1, direction on 1 of 1 seed "
                        "| direction only: -2.50 [-3.00, -2.00]; interval holds on 1 of 1, direction on 1 of 1 seed |")
    # every column names the JSONs its cells come from
    assert claims[claims.index("") + 3] == (
        "Sources: early stopping, per-family rates: `benchmarks/results/sciq_grid.json`; fixed budget, one rate for "
        "all: `benchmarks/results/sciq_grid_shared_lr.json`, intervals "
        f"`benchmarks/results/sciq_grid_shared_lr_intervals.json`; {label}: `benchmarks/results/{name}.json`, "
        f"intervals `benchmarks/results/{name}_intervals.json`.")
    elsewhere = grid_sections(RESULTS, parse_paper(TEX), "sciq_grid_shared_lr", {"sciq_grid": RESULTS},
                              intervals_for(ece_claim, entry), read={"sciq_grid_shared_lr": ("/x/r.json", "/x/i.json")})
    assert ("fixed budget, one rate for all: `/x/r.json`, intervals `/x/i.json`."
            in elsewhere["sciq_grid_shared_lr/claims"])  # the files the caller read (--results, --intervals)
    waiting = grid_sections(RESULTS, parse_paper(TEX), "sciq_grid_shared_lr", {"sciq_grid": RESULTS},
                            intervals_for(ece_claim, entry), arms={label: None})["sciq_grid_shared_lr/claims"]
    assert f"{label} (pooled" not in waiting.splitlines()[0]
    assert f"{name}_intervals.json" not in waiting.split("Sources: ")[1].split("\n")[0]
    assert waiting.endswith(f"python -m benchmarks.grid_intervals --grid {name} --against sciq_grid_shared_lr.")


@pytest.mark.skipif(not default_paper().is_file(), reason=f"the paper's source {default_paper()} is not here")
def test_the_docs_page_matches_the_one_rate_grids_committed_results_and_intervals(monkeypatch):
    monkeypatch.chdir(REPO)  # the earlier grids, the intervals and the regime checks are read from benchmarks/results
    assert main(["--grid", "sciq_grid_shared_lr", "--check"]) == 0


def test_an_interval_cell_says_on_how_many_seeds_the_data_speak_against_the_claim():
    from benchmarks.paper_comparison import CLAIMS, interval_cell

    ts = next(c for c in CLAIMS if "temperature" in c.text)
    entry = {"seeds": 3, "pooled": {"difference": 2.234, "ci95": [0.519, 2.978], "verdict": "no", "against": True},
             "held_on": 0, "direction_on": 0, "against_on": 2,
             "over_seeds": {"difference": 2.234, "ci95": [-0.61, 5.08], "verdict": "no", "against": False}}
    # not a comparison the paper makes: "does not hold", not "not reproduced"; the pooled interval lies against it,
    # the one over seeds (for a seed drawn at random) cannot tell
    assert interval_cell(ts, entry) == ("does not hold (against): +2.23 [+0.52, +2.98]; over seeds [-0.61, +5.08]; "
                                        "interval holds on 0 of 3, direction on 0 of 3, against it on 2 of 3 seeds")
    assert "against" not in interval_cell(ts, {**entry, "against_on": 0, "pooled": {**entry["pooled"],
                                                                                      "against": False}})
    assert interval_cell(ts, {"seeds": 0}) == "–"


def test_a_claims_word_follows_its_pooled_interval_and_its_seeds():
    from benchmarks.paper_comparison import interval_verdict

    ece = next(c for c in CLAIMS if c.text == "IB-EDL is better calibrated than MAP (ECE, points)")

    def entry(verdict, held_on=2, against_on=0, against=False, over_seeds="holds"):
        return {"seeds": 3, "pooled": {"difference": -1.0, "ci95": [-2.0, -0.5], "verdict": verdict,
                                       "against": against}, "held_on": held_on, "direction_on": 3,
                "against_on": against_on, "over_seeds": {"difference": -1.0, "ci95": [-1.8, -0.2],
                                                         "verdict": over_seeds, "against": False}}

    assert interval_verdict(ece, entry("holds")) == "reproduced"
    assert interval_verdict(ece, entry("holds", over_seeds="direction")) == "direction only"  # a new seed may not
    one_seed = {k: v for k, v in entry("holds").items() if k != "over_seeds"} | {"seeds": 1, "held_on": 1}
    assert interval_verdict(ece, one_seed) == "direction only"  # one seed shows no seed spread
    assert interval_verdict(ece, entry("holds", held_on=1)) == "direction only"  # pooled, but 1 seed of 3 alone
    assert interval_verdict(ece, entry("holds", against_on=1)) == "direction only"  # one seed's interval against it
    assert interval_verdict(ece, entry("direction", against_on=1)) == "direction only"
    assert interval_verdict(ece, entry("no")) == "not reproduced"
    assert interval_verdict(ece, entry("no", against=True)) == "not reproduced (against)"
    stale = {k: v for k, v in entry("holds").items() if k != "over_seeds"}  # written before the interval existed
    with pytest.raises(ValueError, match="lack the interval over seeds: run benchmarks.grid_intervals again"):
        interval_verdict(ece, stale)
    with pytest.raises(ValueError, match="lack a pooled verdict: run benchmarks.grid_intervals again"):
        interval_verdict(ece, {"seeds": 1, "pooled": {"difference": 0.0, "ci95": [0, 0]}, "held_on": 0})


def test_a_no_worse_claim_below_its_tolerance_is_not_reproduced():
    par = next(c for c in CLAIMS if c.better == "no_worse")
    runs = [record("id", "ib_edl", 0, accuracy=0.9, without={"accuracy": 0.855}),
            record("id", "map", 0, accuracy=0.87)]
    assert claim_cell(par, runs) == "not reproduced: -1.50 (0 of 1 seed)"
