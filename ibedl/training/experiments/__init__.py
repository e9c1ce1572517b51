"""Experiments: the benchmark grid and its runner (``benchmark``), one run's evaluation in a child process
(``evaluate_run``) and the report (``report``). Imports go one way: benchmark -> evaluate_run, report."""
