"""Scripts the tests run as processes of their own, through `helpers.run_script`, which puts tests/ and examples/ on
their PYTHONPATH (for `helpers`, the test modules and `example_utils`). Not collected by pytest (no test_*.py names);
a package so that a test can import a worker's setup (`from workers.trainer_fsdp_worker import fsdp_setup`)."""
