"""Data loading and model building shared by the example scripts, the benchmarks and the tests. Not part of the
library (which takes any `datasets` dataset and any model): the example scripts put this folder on `sys.path`."""
