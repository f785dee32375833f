"""Level 4: running a model. model: optiml.Model, the user's API, over the parts here: loading (the file,
mapped or in memory), plan (where layers run), sparsity (which FFN neurons are skipped), sequences (decode
and the KV cache API the server uses), generation (stream's loop, the chat prefix), chat_template, sampling,
tokenizer, batch (optiml.Batch), timeline (where a step's time goes), timing (llama-bench style speed),
checks (argument checks)."""
