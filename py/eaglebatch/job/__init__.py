"""The job: the YAML file read strictly (loading), its frozen config (config), the model files
it names (model_files, GGUF conversion in gguf_model, the builtin model and prompts in builtin),
its input files checked before work (inputs, through the extension), the scheduler's settings
(scheduler_config) and the fingerprints that give a job its identity (fingerprint)."""
