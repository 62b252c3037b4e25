"""What sits on top of the library and is never imported by it: the command line, the demo,
benchmarks, reports, pictures and test clusters (the cluster in a box included)."""
