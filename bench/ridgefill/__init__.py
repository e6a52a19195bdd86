"""RidgeFill: TTFT against exact prefill, and probes of why its filled rows retrieve or not."""
