"""scripts/perf_table.py: the engine table of docs/measurements.md is generated from the benchmark's CSVs."""

from __future__ import annotations

from tests.script_modules import load_script

HEADER = "workload,system,system_name,total_s,rounds_s,later_round_s,accuracy,max_weight_diff,fedsim_over_raw," \
         "flower_over_fedsim,note,rounds,cpu_count\n"


def perf_table():
    return load_script("scripts/perf_table.py")


def test_docs_measurements_engine_table_is_up_to_date() -> None:
    assert perf_table().main(["--check"]) == 0


def test_a_later_file_replaces_a_row_and_hand_edits_are_caught(tmp_path, capsys) -> None:
    pt = perf_table()
    (tmp_path / "engine-1.csv").write_text(HEADER + "mlp-1000,raw,raw PyTorch,5.0,,1.6,0.7,,,,,3,2\n"
                                           "mlp-1000,sequential,\"fedsim local, sequential\",7.0,,2.2,0.7,0,1.4,,,3,2\n"
                                           "mlp-100,raw,raw PyTorch,0.5,,0.16,0.7,,,,,3,2\n")
    (tmp_path / "engine-2.csv").write_text(HEADER + "mlp-1000,sequential,\"fedsim local, sequential\",6.0,,2.0,0.7,0,"
                                           "1.2,,,3,2\n")
    doc = tmp_path / "m.md"
    doc.write_text("intro\n<!-- perf:engine start -->\nold\n<!-- perf:engine end -->\nafter\n")
    args = ["--csv-dir", str(tmp_path), "--doc", str(doc)]
    assert pt.main([*args, "--check"]) == 1
    assert pt.main(args) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("\nafter\n") and "old" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| mlp")]
    assert [ln.split(" | ")[0] for ln in lines] == ["| mlp-100", "| mlp-1000", "| mlp-1000"]  # 100 before 1000
    assert "| 1.20 |" in lines[2] and "engine-2.csv" in lines[2]  # the later file's row
    assert pt.main([*args, "--check"]) == 0
    doc.write_text(text.replace("1.20", "1.10"))
    assert pt.main([*args, "--check"]) == 1


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    pt = perf_table()
    assert pt.main(["--csv-dir", str(tmp_path), "--doc", str(tmp_path / "m.md")]) == 2
    assert "no engine*.csv files" in capsys.readouterr().err
    (tmp_path / "engine-x.csv").write_text("a,b\n1,2\n")
    (tmp_path / "m.md").write_text("no markers\n")
    assert pt.main(["--csv-dir", str(tmp_path), "--doc", str(tmp_path / "m.md")]) == 2
    assert "not a bench_engine.py --csv file" in capsys.readouterr().err


RAY_HEADER = "workload,nodes,cpus_per_node,actors,clients,rounds,ms_per_client,local_s,ray_s,calls_per_task," \
             "ray_batched_s,ray_startup_s,identical\n"


def test_the_ray_table_renders_where_the_document_has_its_block(tmp_path, capsys) -> None:
    pt = perf_table()
    (tmp_path / "engine-1.csv").write_text(HEADER + "mlp-100,raw,raw PyTorch,0.5,,0.16,0.7,,,,,3,2\n")
    doc = tmp_path / "m.md"
    doc.write_text("<!-- perf:engine start -->\n<!-- perf:engine end -->\n<!-- perf:ray start -->\nold\n<!-- perf:ray end -->\n")
    args = ["--csv-dir", str(tmp_path), "--doc", str(doc)]
    assert pt.main(args) == 2 and "no ray-scaleout*.csv files" in capsys.readouterr().err
    (tmp_path / "ray-scaleout-1.csv").write_text(RAY_HEADER + "mlp:1,2,1,2,100,4,1.40,0.144,0.352,16,0.120,6.4,1\n")
    assert pt.main(args) == 0
    (row,) = [ln for ln in doc.read_text().splitlines() if ln.startswith("| mlp:1")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:9] == ["mlp:1", "1.4 ms", "0.144", "0.352", "0.41", "0.120 (16 calls/task)", "1.20", "0.60", "6.4"]
    assert pt.main([*args, "--check"]) == 0


def test_the_vectorise_table_summarises_grid_points_per_model_and_cohort(tmp_path) -> None:
    pt = perf_table()
    (tmp_path / "engine-1.csv").write_text(HEADER + "mlp-100,raw,raw PyTorch,0.5,,0.16,0.7,,,,,3,2\n")
    head = "model,clients,per_client,batch_size,optimizer,dp,device,sequential_s,vectorised_s,auto_vectorises,verdict\n"
    (tmp_path / "vectorise-1.csv").write_text(head + "mlp:32,100,4,16,sgd,1,cpu,0.4,0.1,1,ok\n"
                                              "mlp:32,100,40,16,sgd,1,cpu,0.3,0.3,1,ok\n"
                                              "mlp:32,100,400,16,sgd,1,cpu,0.2,0.4,1,WRONG\n")
    (tmp_path / "vectorise-2.csv").write_text(head + "mlp:32,100,400,16,sgd,1,cpu,0.6,0.2,1,ok\n")  # timed again
    doc = tmp_path / "m.md"
    doc.write_text("<!-- perf:engine start -->\n<!-- perf:engine end -->\n"
                   "<!-- perf:vectorise start -->\n<!-- perf:vectorise end -->\n")
    assert pt.main(["--csv-dir", str(tmp_path), "--doc", str(doc)]) == 0
    (row,) = [ln for ln in doc.read_text().splitlines() if ln.startswith("| yes")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:10] == ["yes", "cpu", "mlp:32", "100", "3", "1.00", "3.00", "4.00", "3", "0"]


def test_a_paired_ratio_shows_its_confidence_interval(tmp_path) -> None:
    pt = perf_table()
    header = HEADER.replace("fedsim_over_raw,", "fedsim_over_raw,ratio_ci_low,ratio_ci_high,ratio_ci_coverage,runs,")
    (tmp_path / "engine-1.csv").write_text(header + "mlp-100,raw,raw PyTorch,0.25,,0.08,0.7,,,,,,9,,,3,2\n"
                                           "mlp-100,sequential,\"fedsim local, sequential\",0.28,,0.09,0.7,0,1.12,"
                                           "1.05,1.19,0.961,9,,,3,2\n")
    table = pt.render(pt.read_rows(list(tmp_path.glob("engine*.csv"))))
    assert "| 1.12 [1.05–1.19] (96%, 9 runs) |" in table
    assert "| raw PyTorch | 0.25 | 0.080 |  |" in table  # no ratio for raw
