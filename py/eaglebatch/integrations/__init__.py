"""Integrations with other tools: lm-evaluation-harness (`lm_eval`), Ray Data (`ray_data`).
Each imports its tool only when imported itself."""
