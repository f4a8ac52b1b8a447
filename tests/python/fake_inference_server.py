"""A fake SGLang / vLLM server for tests/http_teacher_test.cc.

Usage: fake_inference_server.py [MODE] --port-file FILE [--listen HOST:PORT] [--model DIR]
                                [--tokenizer DIR] [--tls-cert PEM --tls-key PEM] [--marker FILE]
                                [--record FILE]

Binds --listen (default 127.0.0.1:0) and writes its port to FILE (atomically), as our servers do. It answers SGLang's
`POST /generate` and vLLM's `POST /v1/completions` in their wire shapes (null first entries, ids
keyed as strings, k or k + 1 entries per position), both at once, plus `/get_model_info`,
`/v1/models`, `/health` and `/tokenize` (the vLLM / SGLang shape
`{"tokens": [...], "count": n, "max_model_len": m}`).

Log-probs:
  - without --model (stdlib only): synthetic, token t has log-prob -(t % 7 + 1) / 10 and the top-k
    are ids 0, 7, 14, ... at -0.1, a known function the test checks against;
  - with --model DIR (a Hugging Face model; needs torch + transformers): the model's own, fp32 on
    CPU in eval mode: position i is scored from log_softmax(logits[i - 1] / temperature), the
    top-k from the same row (SGLang applies the request's temperature; vLLM cannot, so its prompt
    log-probs are at temperature 1, as vLLM's are).
/tokenize needs a tokenizer: --tokenizer DIR, or the model directory when it holds one; without
one it answers 404 (the client then cannot check the tokenizer, as with a server that has none).

MODE: ok | nan | minus9999 | short | reorder | error500 | slow (3 s before each scoring reply) |
hang (never replies to scoring) | drop (half a reply, then the connection is cut) | wrongtok
(/tokenize gives a wrong last id). --marker FILE is written when a scoring request has been read
(the test synchronises on it). --record FILE gets one JSON line per scored sequence: the api, the
tokens and the log-probs sent back.
"""
import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ["ok", "nan", "minus9999", "short", "reorder", "error500", "slow", "hang", "drop",
         "wrongtok"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="ok", choices=MODES)
    ap.add_argument("--port-file", required=True, help="the bound port is written here")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (port 0: any)")
    ap.add_argument("--model", help="a Hugging Face model directory: real log-probs")
    ap.add_argument("--tokenizer", help="tokenizer directory for /tokenize (default: the model's)")
    ap.add_argument("--tls-cert", help="serve HTTPS with this certificate chain (PEM)")
    ap.add_argument("--tls-key", help="the certificate's private key (PEM)")
    ap.add_argument("--marker", help="written when a scoring request has been read")
    ap.add_argument("--record", help="JSON lines of every scored sequence")
    return ap.parse_args()


ARGS = parse_args()
MODE = ARGS.mode


class Position:
    """What a server knows of one scored position: the token's log-prob, its 1-based rank in the
    vocabulary, and the top-k (log-prob, id) pairs, most likely first."""

    def __init__(self, lp, rank, top):
        self.lp, self.rank, self.top = lp, rank, top


class SyntheticScorer:
    name = "fake"
    max_len = 4096

    def positions(self, seq, temperature, k):
        del temperature  # the synthetic values do not depend on it
        top = [(-0.1, 7 * i) for i in range(k)]
        ids = [i for _, i in top]
        return [Position(-((t % 7) + 1) / 10.0, ids.index(t) + 1 if t in ids else 100, top)
                for t in seq[1:]]

    def text(self, t):
        del t
        return "x"


class ModelScorer:
    """The model's log-probs, one sequence per forward (no padding, so nothing to mask)."""

    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.name = model_dir
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.lock = threading.Lock()  # one forward at a time: deterministic and small

    def positions(self, seq, temperature, k):
        torch = self.torch
        if len(seq) < 2:
            return []
        with self.lock, torch.no_grad():
            logits = self.model(input_ids=torch.tensor([seq])).logits[0].float()
        logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)  # row i scores token i + 1
        target = torch.tensor(seq[1:]).unsqueeze(1)
        lps = logp.gather(1, target).squeeze(1)
        ranks = (logp > lps.unsqueeze(1)).sum(1) + 1
        out = []
        top_lp, top_id = (logp.topk(k, dim=-1) if k > 0 else (None, None))
        for p in range(len(seq) - 1):
            top = [] if k == 0 else list(zip(top_lp[p].tolist(), top_id[p].tolist()))
            out.append(Position(float(lps[p]), int(ranks[p]), top))
        return out

    def text(self, t):
        return TOKENIZER.decode([t]) if TOKENIZER is not None else None


def load_tokenizer():
    d = ARGS.tokenizer or ARGS.model
    if d is None or not os.path.exists(os.path.join(d, "tokenizer.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(d)


SCORER = ModelScorer(ARGS.model) if ARGS.model else SyntheticScorer()
TOKENIZER = load_tokenizer()
RECORD_LOCK = threading.Lock()


def record(api, seq, lps):
    if not ARGS.record:
        return
    with RECORD_LOCK, open(ARGS.record, "a") as f:
        f.write(json.dumps({"api": api, "tokens": seq, "logprobs": lps}) + "\n")


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, code, obj):
        body = json.dumps(obj).encode()
        if MODE == "drop" and self.path in ("/generate", "/v1/completions"):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, {})
        if self.path == "/get_model_info":
            name = ARGS.model or "fake-sglang"
            return self.reply(200, {"model_path": name, "tokenizer_path": ARGS.tokenizer or name,
                                    "is_generation": True})
        if self.path == "/v1/models":
            return self.reply(200, {"data": [{"id": ARGS.model or "fake-vllm", "object": "model",
                                              "max_model_len": SCORER.max_len}]})
        self.reply(404, {"error": "no such path"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.path in ("/tokenize", "/v1/tokenize"):
            return self.tokenize(req)
        if ARGS.marker and self.path in ("/generate", "/v1/completions"):
            write_atomically(ARGS.marker, self.path)
        if MODE == "error500":
            return self.reply(500, {"error": "boom"})
        if MODE == "slow":
            time.sleep(3)
        if MODE == "hang":
            time.sleep(600)
        if self.path == "/generate":
            return self.sglang(req)
        if self.path == "/v1/completions":
            return self.vllm(req)
        self.reply(404, {"error": "no such path"})

    def tokenize(self, req):
        if TOKENIZER is None:
            return self.reply(404, {"error": "this fake has no tokenizer"})
        ids = TOKENIZER.encode(req["prompt"], add_special_tokens=req.get("add_special_tokens", True))
        if MODE == "wrongtok" and ids:
            ids[-1] = (ids[-1] + 1) % len(TOKENIZER)
        self.reply(200, {"tokens": ids, "count": len(ids), "max_model_len": SCORER.max_len})

    def sglang(self, req):
        ids = req["input_ids"]
        starts = req["logprob_start_len"]
        k = req.get("top_logprobs_num", 0)
        temperature = req.get("sampling_params", {}).get("temperature", 1.0)
        out = []
        for seq, s in zip(ids, starts):
            pos = SCORER.positions(seq, temperature, k)[s:]  # positions s + 1 .. L - 1
            tok = [[None, seq[s], None]] + [
                [p.lp, t, SCORER.text(t)] for p, t in zip(pos, seq[s + 1:])]
            item = {"text": "", "meta_info": {"input_token_logprobs": tok}}
            if k:
                item["meta_info"]["input_top_logprobs"] = [None] + [
                    [[l, i, SCORER.text(i)] for l, i in p.top] for p in pos]
            record("sglang", seq, [p.lp for p in pos])
            out.append(item)
        if MODE == "short":
            out[0]["meta_info"]["input_token_logprobs"].pop()
        if MODE == "nan":
            out[0]["meta_info"]["input_token_logprobs"][1][0] = float("nan")
        self.reply(200, out)

    def vllm(self, req):
        k = req.get("prompt_logprobs", 0)
        choices = []
        for n, seq in enumerate(req["prompt"]):
            pos = SCORER.positions(seq, 1.0, k)
            pl = [None]
            for p, t in zip(pos, seq[1:]):
                d = {str(i): {"logprob": l, "rank": r + 1, "decoded_token": SCORER.text(i)}
                     for r, (l, i) in enumerate(p.top)}
                if str(t) not in d:  # k + 1 entries: the sampled token outside the top k
                    d[str(t)] = {"logprob": p.lp, "rank": p.rank, "decoded_token": SCORER.text(t)}
                pl.append(d)
            record("vllm", seq, [p.lp for p in pos])
            choices.append({"index": n, "text": "", "prompt_logprobs": pl})
        if MODE == "minus9999":
            for v in choices[0]["prompt_logprobs"][-1].values():
                v["logprob"] = -9999.0
        if MODE == "reorder":
            choices.reverse()
        if MODE == "short":
            choices.pop()
        self.reply(200, {"choices": choices})


def main():
    host, _, port = ARGS.listen.rpartition(":")
    srv = ThreadingHTTPServer((host, int(port)), H)
    if ARGS.tls_cert:
        import ssl
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(ARGS.tls_cert, ARGS.tls_key)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    write_atomically(ARGS.port_file, str(srv.server_address[1]))
    srv.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
