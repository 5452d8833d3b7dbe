"""Benchmarks behind `moekit bench`: roofline floors, peers run in the same process, CPU/GPU drivers."""
