"""Throughput, FLOPs and MFU."""
