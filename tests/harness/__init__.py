"""What the tests share that is not a test: worker modules, harnesses, the model of the scripts."""
