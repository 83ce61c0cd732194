"""The estimator: peak memory of a training step and the longest sequence that fits, per mode, from fake-tensor
profiles of the code that will run (``hf_memo.estimate``, ``hf-memo estimate``).

Its modules by concern:

- :mod:`.question`: the model and the budgets asked about;
- :mod:`.cluster`: ranks, nodes, ZeRO settings, sequence parallelism's buffers, reserves;
- :mod:`.model_states`: parameters, gradients and optimizer state, whole and per rank;
- :mod:`.setups`: the modes profiled (``none``, ``full``, ``selective``, ``memo`` and the two baselines);
- :mod:`.fitted`, :mod:`.policy_footprint`: activation memory as closed forms fitted to profiles;
- :mod:`.fit_cache`: fits kept in this process and on disk;
- :mod:`.memo_policy`: the memory policy memo's solver picks, sized by its own profiles;
- :mod:`.time_model`: step-time and MFU bounds;
- :mod:`.estimate`: a question answered; :mod:`.report`: the answer as a table or JSON.
"""
