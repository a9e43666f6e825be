"""What a job leaves on disk: the output directory and its part files (directory), exactly-once
resume (resume), shards (shards), the OpenAI Batch results file (openai_results, results_file)
and the run summary (summary_json). Below the engine: nothing here imports it."""
