"""The ``fedsim`` command line: ``list``, ``run``, ``reproduce``, ``sweep``, ``compare``, ``ui``, ``export``,
``run-app``.

Errors the user can fix print one line (``fedsim: error: ...``) and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, NoReturn, Sequence

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors on one line."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"fedsim: error: {message} (see fedsim {self.prog.split()[-1]} --help)\n"
                         if " " in self.prog else f"fedsim: error: {message} (see fedsim --help)\n")
        raise SystemExit(EXIT_USAGE)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value


def _run_id(text: str) -> str:
    """An MLflow run id (32 hex characters), checked before anything starts."""
    from fedsim.errors import ConfigError
    from fedsim.validation import check_run_id

    try:
        return check_run_id(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seed_count(text: str) -> int:
    value = _positive_int(text)
    if not 1 <= value <= MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_SEEDS} seeds, got {value}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1 to 65535, got {value}")
    return value


def _finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


MAX_SEEDS = 10_000

PLUGIN_HELP = ("import MODULE first (repeatable), so its @STRATEGIES.register(...) etc. add names; recorded in "
               "the config's plugins, so engine processes import it too (it must be importable there: installed, "
               "on PYTHONPATH or in the working directory)")


def _add_plugin_arg(sub: argparse.ArgumentParser, help_extra: str = "") -> None:
    sub.add_argument("--plugin", action="append", default=[], metavar="MODULE", help=PLUGIN_HELP + help_extra)


def build_parser() -> argparse.ArgumentParser:
    from fedsim.registry import ENGINES

    parser = _Parser(prog="fedsim", description="Federated and continual learning simulation platform.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ls = sub.add_parser("list", help="list the experiments, one line each (--long: a table with their kinds)")
    ls.add_argument("--long", action="store_true",
                    help="a table with each experiment's kind and whole first description line")

    run = sub.add_parser("run", help="run an experiment (a name from `fedsim list` or a YAML path)")
    run.add_argument("experiment", help="experiment name or path/to/experiment.yaml")
    run.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides, e.g. client.lr=0.05")
    run.add_argument("--rounds", type=_positive_int, help="number of federated rounds")
    run.add_argument("--clients", type=_positive_int, help="number of simulated clients")
    run.add_argument("--seed", type=_positive_int, help="root seed (all randomness derives from it)")
    run.add_argument("--engine", choices=ENGINES.names(),
                     help="local (in-process), ray (fedsim's long-lived Ray actors) or flower (Flower's simulation)")
    run.add_argument("--eps", type=float, help="target privacy budget ε (DP experiments only)")
    run.add_argument("--tracking-uri", help="MLflow tracking URI; wins over $MLFLOW_TRACKING_URI, which wins over the "
                     "experiment's tracking.uri (default: sqlite:///mlflow.db in the cwd)")
    run.add_argument("--no-tracking", action="store_true", help="do not record to MLflow")
    run.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    run.add_argument("--quiet", action="store_true",
                     help="no progress bar or summary: stdout gets only the MLflow run id, as `run <id>`")
    run.add_argument("--verbose", action="store_true", help="show Flower/Ray logs")
    run.add_argument("--resume", metavar="RUN_ID", type=_run_id,
                     help="continue an interrupted run from its last checkpoint, in the same MLflow run")
    _add_plugin_arg(run)

    rep = sub.add_parser("reproduce", help="run a claim check: a grid of configurations × seeds as one MLflow parent run")
    rep.add_argument("claim", help="claim name (experiments/reproduce/NAME.yaml) or a YAML path")
    rep.add_argument("overrides", nargs="*", help="overrides applied to every run, e.g. rounds=5")
    rep.add_argument("--seeds", type=_seed_count, help="number of seeds (0..N-1) instead of the spec's list")
    rep.add_argument("--tracking-uri", help="MLflow tracking URI")
    rep.add_argument("--resume", metavar="PARENT_RUN_ID", type=_run_id,
                     help="continue an interrupted claim check, or raise its seeds (a spec with more seeds; "
                          "recorded as a post-hoc raise): finished runs are read back, the rest run")
    rep.add_argument("--plan", action="store_true",
                     help="print the runs (tuning and final) and an estimated time, then exit; records nothing")
    rep.add_argument("--scale", default="default", metavar="{quick,default,paper}",
                     help="which spec of NAME: NAME_quick.yaml, NAME.yaml (default) or NAME_paper.yaml")
    _add_plugin_arg(rep, "; every run gets the override plugins=[...] of the --plugin modules")

    sw = sub.add_parser("sweep", help="run a grid × seeds as parallel Ray Tune trials under one MLflow parent run")
    sw.add_argument("sweep", help="a sweep (experiments/sweeps/NAME.yaml or a path) or an experiment name with --grid")
    sw.add_argument("overrides", nargs="*", help="overrides applied to every trial (before --grid), e.g. rounds=5")
    sw.add_argument("--grid", nargs="+", default=[], metavar="KEY=V1,V2",
                    help="grid axes, e.g. eps=1,3,6 strategy=fedsvd,ffa_lora client.lr=0.01,0.05")
    sw.add_argument("--seeds", type=_seed_count, help="number of seeds (0..N-1) per configuration")
    sw.add_argument("--samples", type=_positive_int, metavar="N",
                    help="random search: N configurations drawn from the --search ranges (each × every seed)")
    sw.add_argument("--search", action="append", default=[], metavar="KEY=DIST",
                    help="a random-search range (repeat for several): uniform(LO,HI), loguniform(LO,HI), "
                         "randint(LO,HI) (HI excluded), quniform/qloguniform/qrandint(LO,HI,Q), lograndint(LO,HI), "
                         "choice(V1,V2,...); e.g. client.lr=loguniform(0.01,1)")
    sw.add_argument("--search-seed", type=int, help="seeds the random search: the same seed, the same samples (default 0)")
    sw.add_argument("--asha", metavar="METRIC", help="stop poor trials early with Ray Tune's ASHA on this per-round "
                                                     "metric, e.g. eval/accuracy")
    sw.add_argument("--asha-mode", choices=["max", "min"], help="maximise (default) or minimise the --asha metric")
    sw.add_argument("--grace-period", type=_positive_int, help="ASHA: rounds every trial runs first (default 1)")
    sw.add_argument("--reduction-factor", type=_finite_float,
                    help="ASHA: keep the top 1/F of the trials at each rung (default 4)")
    sw.add_argument("--address", help="an existing Ray cluster (e.g. auto); default: $RAY_ADDRESS or a local runtime")
    sw.add_argument("--cpus-per-trial", type=_finite_float, help="CPUs each trial reserves (and its torch threads)")
    sw.add_argument("--gpus-per-trial", type=_finite_float,
                    help="GPUs each trial reserves (default 0; 0.5 puts two trials on a GPU); its trials run on "
                         "engine.device=cuda, the GPU Ray gives them")
    sw.add_argument("--max-concurrent", type=_positive_int,
                    help="at most this many trials at once (default: as CPUs and GPUs allow)")
    sw.add_argument("--tracking-uri", help="MLflow tracking URI")
    sw.add_argument("--resume", metavar="PARENT_RUN_ID", type=_run_id,
                    help="continue an interrupted sweep: finished trials are read back, the rest run")
    _add_plugin_arg(sw, "; every trial gets the override plugins=[...] of the --plugin modules")

    cmp = sub.add_parser("compare", help="table and plots of a sweep's / claim check's runs (mean ± std over seeds)")
    cmp.add_argument("parent", nargs="?", type=_run_id, help="the parent run id of a sweep or claim check")
    cmp.add_argument("--experiment", help="compare the top-level runs of `fedsim run EXPERIMENT` instead")
    cmp.add_argument("--metric", action="append", dest="metrics",
                     help="a metric to compare (repeat for several; default: the sweep's own metrics)")
    cmp.add_argument("--out", help="where to write the plots (default: a temporary folder; logged to the parent)")
    cmp.add_argument("--tracking-uri", help="MLflow tracking URI")

    ex = sub.add_parser("export", help="write an experiment as a Flower app that `flwr run` executes")
    ex.add_argument("experiment", help="experiment name or path/to/experiment.yaml (a federated one)")
    ex.add_argument("dir", help="the app directory to write (new or empty; --force overwrites)")
    ex.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides, e.g. client.lr=0.05")
    ex.add_argument("--rounds", type=_positive_int, help="number of federated rounds (the app's num-server-rounds)")
    ex.add_argument("--clients", type=_positive_int, help="number of simulated clients (the federation's SuperNodes)")
    ex.add_argument("--seed", type=_positive_int, help="root seed")
    ex.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    _add_plugin_arg(ex)

    ra = sub.add_parser("run-app", help="run a Flower app directory (ServerApp + ClientApp) on a fedsim engine, "
                                       "tracked in MLflow")
    ra.add_argument("path", help="the Flower app directory (its pyproject.toml has [tool.flwr.app])")
    ra.add_argument("overrides", nargs="*", help="run-config overrides key=value (declared keys only), e.g. lr=0.05")
    ra.add_argument("--run-config", action="append", default=[], metavar="'KEY=VALUE ...'",
                    help="run-config overrides as `flwr run --run-config` takes them (repeatable)")
    ra.add_argument("--engine", default="local",
                    help="local (in-process, default), ray (fedsim's Ray actors) or flower (Flower's simulation)")
    ra.add_argument("--num-nodes", type=_positive_int,
                    help="simulated nodes (default: the app's options.num-supernodes, else 10)")
    ra.add_argument("--seed", type=_positive_int, default=0, help="root seed of the server and every client call")
    ra.add_argument("--tracking-uri", help="MLflow tracking URI (default as for `run`)")
    ra.add_argument("--no-tracking", action="store_true", help="do not record to MLflow")
    ra.add_argument("--quiet", action="store_true", help="no progress bar or summary: stdout gets only `run <id>`")
    ra.add_argument("--verbose", action="store_true", help="show Flower/Ray logs")

    ui = sub.add_parser("ui", help="open the MLflow UI on 127.0.0.1 over the same store")
    ui.add_argument("--port", type=_port, default=5000, help="a free TCP port on 127.0.0.1 (1-65535)")
    ui.add_argument("--tracking-uri", help="MLflow tracking URI (default as for `run`)")
    return parser


def cmd_list(long: bool = False) -> int:
    """One line per experiment (name and description, cut to the terminal width); ``long``: the table."""
    from fedsim import config as C

    rows = []
    for name in C.list_experiments():
        data = C.read_yaml(C.EXPERIMENTS_DIR / f"{name}.yaml")
        learner = (data.get("client") or {}).get("learner", "supervised")
        kind = f"central: {data['method']}" if "method" in data else f"engine: {learner}"  # centralised = 1 node
        rows.append((name, kind, str(data.get("description", "")).strip().split("\n")[0]))
    if long:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="fedsim experiments", show_header=True, header_style="bold")
        table.add_column("name")
        table.add_column("kind")
        table.add_column("description")
        for name, kind, description in rows:
            table.add_row(name, kind, description)
        Console().print(table)
        return 0
    width = shutil.get_terminal_size().columns  # $COLUMNS, the terminal, else 80
    pad = max((len(name) for name, _, _ in rows), default=0)
    try:
        for name, _, description in rows:
            sys.stdout.write(_fit(f"{name:<{pad}}  {description}".rstrip(), width) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `fedsim list | head`: the reader left; no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _fit(line: str, width: int) -> str:
    """``line`` cut to ``width`` terminal cells, ending in "…" where it was cut."""
    from rich.cells import cell_len, set_cell_size

    if cell_len(line) <= width:
        return line
    return set_cell_size(line, max(width - 1, 0)).rstrip() + "…"


def _apply_eps(cfg: Any, eps: float | None) -> None:
    """``--eps E`` turns on sample-level DP-SGD with target ε = E (the learner must support DP)."""
    if eps is None:
        return
    if cfg.privacy.noise_multiplier is not None:
        from fedsim.errors import ConfigError

        raise ConfigError(f"set either --eps or privacy.noise_multiplier, not both (σ = "
                          f"{cfg.privacy.noise_multiplier} would be replaced by one calibrated for ε = {eps}); "
                          f"drop one of them")
    cfg.privacy.enabled = True
    cfg.privacy.epsilon = eps
    cfg.privacy.noise_multiplier = None


def cmd_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fedsim import config as C

    if C.is_central(args.experiment):
        return cmd_run_central(args)
    flags = {"rounds": args.rounds, "clients": args.clients, "seed": args.seed, "engine": args.engine}
    cfg = C.load_config(args.experiment, args.overrides, flags)
    cfg.plugins = list(dict.fromkeys([*cfg.plugins, *args.plugin]))  # engine processes import them too
    _apply_eps(cfg, args.eps)
    C.validate(cfg)
    if args.no_tracking:
        cfg.tracking.enabled = False
    if not args.print_config:
        _check_checkpoint_dir(cfg)
    cfg.engine.verbose = cfg.engine.verbose or args.verbose
    console = Console(stderr=False, quiet=args.quiet)
    if args.print_config:
        Console().print(C.to_yaml(cfg), markup=False, highlight=False)
        return 0
    from fedsim.progress import RoundProgress, summary_table

    started = getattr(args, "started", None) or time.perf_counter()
    label = f"{cfg.name} · {cfg.strategy.name} · {cfg.engine.name}"
    typed = [*args.overrides, *(f"{k}={v}" for k, v in (("eps", args.eps), ("rounds", args.rounds),
                                                           ("clients", args.clients)) if v is not None)]
    if args.quiet:
        from fedsim.runner import default_run_name, run_experiment

        summary = run_experiment(cfg, tracking_uri=args.tracking_uri, resume_run_id=args.resume,
                                 run_name=default_run_name(cfg, typed))
    else:
        with RoundProgress(cfg.rounds, label, console, started=started) as progress:
            progress.on_phase("loading torch and Flower")
            from fedsim.runner import default_run_name, run_experiment  # torch, Flower: not for --print-config

            summary = run_experiment(cfg, observers=[progress], tracking_uri=args.tracking_uri,
                                     resume_run_id=args.resume, run_name=default_run_name(cfg, typed))
    total = time.perf_counter() - started
    if args.quiet:  # scripts capture the run id: `run <id>`, the one line on stdout
        if summary.run_id:
            print(f"run {summary.run_id}", flush=True)
        return 0
    extra = {"wall time (total)": f"{total:.1f} s", "wall time (engine + rounds)": f"{summary.wall_seconds:.1f} s"}
    if summary.run_id:
        extra.update({"mlflow run": summary.run_id, "tracking uri": summary.tracking_uri or ""})
    console.print(summary_table(f"{cfg.name}: final round {cfg.rounds}", summary.history, extra))
    if summary.run_id:
        console.print("Open the results with [bold]fedsim ui[/bold].")
    return 0


def _check_checkpoint_dir(cfg: Any) -> None:
    """A run that will checkpoint fails now, not after its first round, when it cannot write them."""
    from fedsim.registry import ENGINES
    from fedsim.validation import check_writable_dir

    if cfg.engine.checkpoint and cfg.tracking.enabled and ENGINES.get(cfg.engine.name).checkpointing:
        check_writable_dir(cfg.engine.checkpoint_dir, "engine.checkpoint_dir")


def cmd_run_central(args: argparse.Namespace) -> int:
    """``fedsim run <method>`` for a centralised-track experiment."""
    started = getattr(args, "started", None) or time.perf_counter()
    from rich.console import Console
    from rich.table import Table

    from fedsim.central_runner import method_params, run_central
    from fedsim import config as C

    federated_only = {"--rounds": args.rounds, "--clients": args.clients, "--engine": args.engine,
                      "--eps": args.eps, "--resume": args.resume}
    given = [flag for flag, value in federated_only.items() if value is not None]
    cfg = C.load_central_config(args.experiment, args.overrides, args.seed)
    if given:
        knobs = [f"params.{k}" for k in cfg.params if re.search(r"steps|epochs|iters|rounds", str(k))][:3]
        hint = f" (its length: {', '.join(knobs)})" if knobs else ""
        raise C.ConfigError(f"{' '.join(given)} applies to federated experiments; {args.experiment!r} is a "
                            f"centralised method: set its params instead{hint}")
    if args.no_tracking:
        cfg.tracking.enabled = False
    method_params(cfg)
    console = Console(quiet=args.quiet)
    if args.print_config:
        Console().print(C.to_yaml(cfg), markup=False, highlight=False)
        return 0
    console.print(f"[bold]{cfg.name}[/bold] · {cfg.method}: {cfg.description}", highlight=False)
    summary = run_central(cfg, tracking_uri=args.tracking_uri, show_progress=not args.quiet)
    if args.quiet:  # as for federated runs: the run id, the one line on stdout
        if summary.run_id:
            print(f"run {summary.run_id}", flush=True)
        return 0
    table = Table(title=f"{cfg.name}: headline metrics", header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.metrics.items():
        table.add_row(key, f"{value:.4g}")
    table.add_row("wall time (total)", f"{time.perf_counter() - started:.1f} s")
    table.add_row("wall time (method)", f"{summary.wall_seconds:.1f} s")
    if summary.run_id:
        table.add_row("mlflow run", summary.run_id)
    console.print(table)
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fedsim.reproduce import claim_name, load_claim, plan_claim, results_table_rows, run_claim, verdicts_or_error

    args.claim = claim_name(args.claim, args.scale)  # the spec at --scale names the run (fedphoenix_paper)
    spec = load_claim(args.claim, args.seeds, args.overrides)
    if args.plugin:
        from fedsim import config as C

        if not C.is_central(spec.experiment):  # a centralised method runs here: the import above suffices
            spec.overrides.append(_plugins_override(spec.experiment, spec.overrides, args.plugin))
    console = Console()
    if args.plan:
        lines = plan_claim(args.claim, spec, tracking_uri=args.tracking_uri)
        console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
        return 0
    console.print(f"[bold]{args.claim}[/bold]: {spec.description}")
    results, parent = run_claim(args.claim, spec, tracking_uri=args.tracking_uri,
                                on_progress=lambda msg: console.print(msg, highlight=False), resume_parent=args.resume)
    _print_table(console, f"{args.claim}: mean ± std over {len(spec.seeds)} seeds", results_table_rows(spec, results))
    verdicts, error = verdicts_or_error(spec, results)
    if verdicts:
        _print_table(console, f"verdicts ({spec.confidence:.0%} {spec.interval} interval, paired seeds)",
                     [v.as_row() for v in verdicts])
    if error:
        console.print(f"[red]verdicts not computed[/red]: {error}", highlight=False)
    for r in results:
        for failure in r.failed:
            console.print(f"[red]failed[/red] {r.label}: {failure}", highlight=False)
    if parent:
        console.print(f"MLflow parent run {parent} (results.md, plots/); open with [bold]fedsim ui[/bold].")
    return 0


def _plugins_override(experiment: str, overrides: list[str], modules: list[str]) -> str:
    """The override that adds the ``--plugin`` modules to the experiment's own ``plugins`` in every
    run's config (so Ray workers import them), as ``fedsim run --plugin`` does: a flag never drops
    a plugin the experiment file (or a ``plugins=`` override) already names."""
    import json

    from fedsim import config as C

    own = C.load_config(experiment, overrides).plugins
    return f"plugins={json.dumps(list(dict.fromkeys([*own, *modules])))}"


def _print_table(console: Any, title: str, rows: list[dict[str, str]]) -> None:
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    cols = list(dict.fromkeys(k for row in rows for k in row))
    for c in cols:
        table.add_column(c)
    for row in rows:
        table.add_row(*(row.get(c, "") for c in cols))
    console.print(table)


def cmd_sweep(args: argparse.Namespace) -> int:
    from rich.console import Console

    from fedsim.reproduce import results_table_rows
    from fedsim.sweep import load_sweep, run_sweep

    name, spec = load_sweep(args.sweep, grid=args.grid, seeds=args.seeds, overrides=args.overrides,
                            cpus_per_trial=args.cpus_per_trial, gpus_per_trial=args.gpus_per_trial,
                            max_concurrent=args.max_concurrent,
                            search=args.search, samples=args.samples, search_seed=args.search_seed,
                            asha=args.asha, asha_mode=args.asha_mode, grace_period=args.grace_period,
                            reduction_factor=args.reduction_factor)
    if args.plugin:
        spec.overrides.append(_plugins_override(spec.experiment, spec.overrides, args.plugin))
    console = Console()
    search = (f", {spec.samples} samples of {dict(spec.search)} (seed {spec.search_seed})" if spec.samples else "")
    asha = (f", ASHA on {spec.asha.metric} ({spec.asha.mode}, grace {spec.asha.grace_period}, "
            f"reduction {spec.asha.reduction_factor:g})" if spec.asha else "")
    grid = f", grid {dict(spec.grid)}" if spec.grid or not spec.samples else ""
    gpus = f" and {spec.gpus_per_trial:g} GPU(s)" if spec.gpus_per_trial > 0 else ""
    summary = (f"[bold]sweep {name}[/bold]: {spec.experiment}{grid}{search}{asha}, "
               f"{len(spec.seeds)} seeds, {spec.cpus_per_trial:g} CPU(s){gpus} per trial")
    with console.status("checking the trials ...") as status:
        results, parent, progress = run_sweep(
            name, spec, tracking_uri=args.tracking_uri, address=args.address, resume_parent=args.resume,
            on_progress=lambda p: status.update(p.line()) if console.is_terminal
            else console.print(p.line(), highlight=False),  # a log file gets one line per change
            on_message=lambda msg: console.print(f"[red]{msg}[/red]", highlight=False),
            # the summary once the trials are known to be valid: a config error stays the only line
            on_checked=lambda: (console.print(summary, highlight=False), status.update("starting Ray ...")))
    console.print(progress.line(), highlight=False)
    _print_table(console, f"sweep {name}: mean ± std over {len(spec.seeds)} seeds", results_table_rows(spec, results))
    for child, stop_round in sorted(progress.stops.items()):
        console.print(f"stopped by ASHA at round {stop_round}: {child}", highlight=False)
    console.print(f"MLflow parent run {parent}; compare with [bold]fedsim compare {parent}[/bold] "
                  f"or [bold]fedsim ui[/bold].", highlight=False)
    return 1 if progress.failed else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from fedsim.compare import compare, from_experiment, from_parent
    from fedsim.errors import ConfigError

    if bool(args.parent) == bool(args.experiment):
        raise ConfigError("give either a parent run id or --experiment NAME")
    if args.out:
        from fedsim.validation import check_writable_dir

        check_writable_dir(args.out, "--out")
    cmp = (from_parent(args.parent, args.metrics, args.tracking_uri) if args.parent
           else from_experiment(args.experiment, args.metrics, args.tracking_uri))
    rows, paths = compare(cmp, args.tracking_uri, Path(args.out) if args.out else None)
    console = Console()
    _print_table(console, f"{cmp.title}: final values, mean ± std over seeds", rows)
    where = f"logged to run {cmp.parent_id} under compare/" if cmp.parent_id else "written"
    console.print(f"{len(paths)} files {where}: {paths[0].parent if paths else ''}", highlight=False)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``fedsim export NAME DIR``: the experiment as a Flower app (see fedsim/export.py)."""
    from fedsim.export import export_app, export_config, package_name

    flags = {"rounds": args.rounds, "clients": args.clients, "seed": args.seed}
    cfg = export_config(args.experiment, args.overrides, flags, args.plugin)
    export_app(args.dir, cfg, force=args.force)
    print(f"wrote the Flower app of {cfg.name} ({cfg.strategy.name}, {cfg.rounds} rounds, {cfg.num_clients} "
          f"clients) to {args.dir}: pyproject.toml, README.md, {package_name(cfg.name)}/")
    print(f"run it where fedsim is installed: FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 flwr run {args.dir} "
          f"--stream --federation-config \"num-supernodes={cfg.num_clients}\"")
    return 0


def cmd_run_app(args: argparse.Namespace) -> int:
    """``fedsim run-app PATH``: a Flower app on a fedsim engine (see fedsim/run_app.py)."""
    from rich.console import Console

    from fedsim.progress import summary_table
    from fedsim.run_app import AppProgress, plan_run, progress_total, run_app

    started = getattr(args, "started", None) or time.perf_counter()
    plan = plan_run(args.path, [*args.run_config, *args.overrides], engine=args.engine, num_nodes=args.num_nodes,
                    seed=args.seed, verbose=args.verbose)
    kwargs = {"plan": plan, "tracking": not args.no_tracking, "tracking_uri": args.tracking_uri,
              "verbose": args.verbose}
    console = Console(quiet=args.quiet)
    if args.quiet:
        summary = run_app(args.path, **kwargs)
        if summary.run_id:
            print(f"run {summary.run_id}", flush=True)
        return 0
    label = f"{plan.app.name} · {plan.engine} · {plan.num_nodes} node{'' if plan.num_nodes == 1 else 's'}"
    with AppProgress(progress_total(plan), label, console, started=started) as progress:
        summary = run_app(args.path, observers=[progress], **kwargs)
    from fedsim.contracts.history import History

    extra = {"wall time (total)": f"{time.perf_counter() - started:.1f} s"}
    if summary.run_id:
        extra.update({"mlflow run": summary.run_id, "tracking uri": summary.tracking_uri or ""})
    last = summary.records[-1].round if summary.records else 0
    console.print(summary_table(f"{plan.app.name}: round {last}", History(summary.records), extra))
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    from fedsim.store import sqlite_path
    from fedsim.tracking import mlflow_client, resolve_tracking_uri

    uri = resolve_tracking_uri(args.tracking_uri, check=True)
    exe = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or shutil.which("mlflow")
    if exe is None:
        from fedsim.errors import FedsimError

        raise FedsimError("the mlflow command is not installed in this environment; run `make install`")
    _check_port_free(args.port)
    if sqlite_path(uri) is not None:  # create/migrate it under the store lock, not racing concurrent runs
        mlflow_client(uri)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    print(f"MLflow UI for {uri} at {ui_url(uri, args.port)} (Ctrl+C to stop)", flush=True)
    cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(args.port), "--backend-store-uri", uri,
           "--workers", "1"]
    return _serve(cmd, env)


def ui_url(uri: str, port: int, experiment: str = "fedsim") -> str:
    """The address that opens MLflow 3's UI on the runs table of ``experiment`` (its ML view; the
    ``workflowType`` parameter overrides the UI's remembered GenAI/ML choice), or on the experiment
    list when the store has no such experiment yet.

    The runs table opens with fedsim's default columns (the headline metrics and the params that
    differ between the experiment's runs): they are written to the store as an MLflow saved view
    (fedsim/ui_view.py) that the address names with ``viewStateShareKey``. Where the view cannot be
    written, the address opens the table with the browser's own column choice."""
    from fedsim.tracking import mlflow_client
    from fedsim.ui_view import VIEW_KEY, write_default_view

    base = f"http://127.0.0.1:{port}"
    exp = client = None
    try:
        client = mlflow_client(uri)
        exp = client.get_experiment_by_name(experiment)
    except Exception:  # noqa: BLE001 - a store the server will report on itself
        pass
    if exp is None:
        return f"{base}/#/experiments?workflowType=machine_learning"
    view = ""
    try:
        write_default_view(client, exp.experiment_id)
        view = f"&viewStateShareKey={VIEW_KEY}"
    except Exception:  # noqa: BLE001 - the table still opens, with the browser's columns
        pass
    return f"{base}/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning{view}"


def _check_port_free(port: int) -> None:
    """Fail with one line when something already listens on 127.0.0.1:``port``."""
    import socket

    from fedsim.errors import FedsimError

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free for a server
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise FedsimError(f"port {port} on 127.0.0.1 is not available ({exc.strerror or exc}); "
                              f"choose another with --port") from None


def _serve(cmd: list[str], env: dict[str, str]) -> int:
    """Run the server in its own process group; Ctrl+C / SIGTERM / SIGHUP stop the whole group."""
    import signal

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum
        raise KeyboardInterrupt

    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 128 + stop["signal"] if stop["signal"] else 0
    finally:
        _stop_group(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it is still there after 10 s."""
    import signal

    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        try:
            os.killpg(proc.pid, 0)  # workers of the group still alive?
        except ProcessLookupError:
            return


def _command_start(argv: Sequence[str] | None) -> float:
    """The ``time.perf_counter()`` at which this command started: the process start for the ``fedsim``
    command itself (``argv`` None: interpreter start-up and imports count too), else now."""
    now = time.perf_counter()
    if argv is None:
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
            age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
            if 0.0 <= age < 3600.0:
                return now - age
        except (OSError, ValueError, IndexError, AttributeError):
            pass
    return now


def main(argv: Sequence[str] | None = None) -> int:
    from fedsim.errors import FedsimError

    started = _command_start(argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.started = started
    if args.command in ("run", "reproduce", "sweep", "export", "run-app"):  # overrides may come after flags: collect the key=value leftovers
        args.overrides = [*args.overrides, *(e for e in extra if "=" in e and not e.startswith("-"))]
        extra = [e for e in extra if e not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from fedsim.logs import quiet_third_party

    quiet_third_party(verbose=getattr(args, 'verbose', False))
    try:
        if getattr(args, "plugin", None):  # before any config is validated: they register names
            from fedsim.registry import import_plugins

            import_plugins(args.plugin, "--plugin")
        if args.command == "list":
            return cmd_list(args.long)
        if args.command == "run":
            return cmd_run(args)
        if args.command == "reproduce":
            return cmd_reproduce(args)
        if args.command == "sweep":
            return cmd_sweep(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "run-app":
            return cmd_run_app(args)
        return cmd_ui(args)
    except FedsimError as exc:
        sys.stderr.write(f"fedsim: error: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        from fedsim.run_lifecycle import exit_soon

        sys.stderr.write("fedsim: interrupted; the run was recorded as KILLED\n")
        exit_soon(130)  # a thread stuck on a hung client must not keep the process alive
        if argv is None:  # the fedsim process itself (not a caller of main()): end it now, see end_interrupted
            from fedsim.run_lifecycle import end_interrupted

            end_interrupted(130)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
