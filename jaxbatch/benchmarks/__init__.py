"""`jaxbatch bench NAME`: one module per benchmark (registry.py lists them) with `main(argv)`, on
base.py and ab.py, over a small library: workloads.py, harness.py, report.py, machine.py,
random_models.py. Importing this package imports nothing."""
