"""The operator's side of OpenTinker: running the services on a machine. Not part of
the client install (it needs the `server` extra).

    stack.py        `opentinker up`: a local nats-server and every service as a child
                    process, restarted when one exits; stopped by PID
    serve_model.py  `opentinker serve-model`: a base model plus a trained adapter or
                    checkpoint behind vLLM's OpenAI-compatible server
    keys.py         `opentinker nats-keys`: a deployment's NATS keys and auth config
"""
