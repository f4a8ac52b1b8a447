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

The synthetic SGLang applies the request's temperature (every log-prob divided by it), as the
model scorer does; mode notemp ignores it, as stock SGLang does for input log-probs.

MODE: ok | nan | minus9999 | short | reorder | error500 | slow (3 s before each scoring reply) |
hang (never replies to scoring) | drop (half a reply, then the connection is cut) | wrongtok
(/tokenize gives a wrong last id) | notemp (SGLang scores at temperature 1 whatever is asked) |
hugelength (a scoring reply announces a 3 GB body, sends a little and stalls) | endless (a
chunked scoring reply that never ends) | notjson (a scoring reply that is not JSON) | one of the
malformed replies in MALFORMED (a field missing, mistyped or out of range; see mangle()).
--marker FILE is written when a scoring request has been read (the test synchronises on it).
--record FILE gets one JSON line per scored sequence: the api, the tokens and the log-probs sent
back; --tokenize-log FILE one line per /tokenize request.

Limits, as the real servers have them: --max-model-len N is reported by /v1/models and a scoring
request with a sequence of N tokens or more is refused (HTTP 400: the request must leave room for
one token); --max-logprobs N refuses a vLLM prompt_logprobs above N (HTTP 400, vLLM's message;
vLLM's default is 20, the fake's none). --tokenize-status CODE answers /tokenize with CODE for the
first --tokenize-failures requests (default: all of them).
"""
import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MALFORMED = ["vllm_no_logprob", "vllm_logprob_string", "vllm_no_rank", "vllm_key_junk",
             "vllm_key_big", "vllm_choice_not_object", "vllm_rank_repeated", "sglang_id_big",
             "sglang_id_string", "sglang_id_vocab", "sglang_meta_not_object",
             "sglang_item_not_object", "sglang_logprob_string"]
MODES = ["ok", "nan", "minus9999", "short", "reorder", "error500", "slow", "hang", "drop",
         "wrongtok", "notemp", "hugelength", "endless", "notjson"] + MALFORMED


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
    ap.add_argument("--tokenize-log", help="a line per /tokenize request")
    ap.add_argument("--max-model-len", type=int, help="context length (refuses longer requests)")
    ap.add_argument("--max-logprobs", type=int, help="largest vLLM prompt_logprobs accepted")
    ap.add_argument("--tokenize-status", type=int, help="HTTP status /tokenize answers with")
    ap.add_argument("--tokenize-failures", type=int, default=-1,
                    help="how many /tokenize requests get --tokenize-status (-1: all)")
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
        top = [(-0.1 / temperature, 7 * i) for i in range(k)]
        ids = [i for _, i in top]
        return [Position(-((t % 7) + 1) / 10.0 / temperature, ids.index(t) + 1 if t in ids else 100,
                         top)
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
if ARGS.max_model_len:
    SCORER.max_len = ARGS.max_model_len
TOKENIZER = load_tokenizer()
RECORD_LOCK = threading.Lock()
TOKENIZE_LOCK = threading.Lock()
TOKENIZE_FAILURES = [ARGS.tokenize_failures]


def record(api, seq, lps):
    if not ARGS.record:
        return
    with RECORD_LOCK, open(ARGS.record, "a") as f:
        f.write(json.dumps({"api": api, "tokens": seq, "logprobs": lps}) + "\n")


def mangle(reply):
    """The malformed reply of MODE, made from a good one (for a request with top-k >= 1)."""
    if MODE.startswith("vllm_"):
        choice = reply["choices"][0]
        last = choice["prompt_logprobs"][-1]
        top = next(key for key, v in last.items() if v["rank"] == 1)
        if MODE == "vllm_no_logprob":
            del last[top]["logprob"]
        elif MODE == "vllm_logprob_string":
            last[top]["logprob"] = "-0.5"
        elif MODE == "vllm_no_rank":
            del last[top]["rank"]
        elif MODE == "vllm_key_junk":
            last[top + "abc"] = last.pop(top)
        elif MODE == "vllm_key_big":
            last[str(2**32 + int(top))] = last.pop(top)
        elif MODE == "vllm_rank_repeated":
            for v in last.values():
                v["rank"] = 1
        elif MODE == "vllm_choice_not_object":
            reply["choices"][0] = 5
    elif MODE.startswith("sglang_"):
        meta = reply[0]["meta_info"]
        if MODE == "sglang_id_big":
            meta["input_top_logprobs"][-1][0][1] = 2**32 + 5
        elif MODE == "sglang_id_string":
            meta["input_top_logprobs"][-1][0][1] = "5abc"
        elif MODE == "sglang_id_vocab":
            meta["input_top_logprobs"][-1][0][1] = 1000
        elif MODE == "sglang_meta_not_object":
            reply[0]["meta_info"] = []
        elif MODE == "sglang_item_not_object":
            reply[0] = 5
        elif MODE == "sglang_logprob_string":
            meta["input_token_logprobs"][-1][0] = "-0.5"
    return reply


def write_atomically(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply_huge(self):
        """Announces 3 GB, sends 64 KiB and stalls: the client must refuse it from the header."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(3 * 10**9))
        self.end_headers()
        try:
            self.wfile.write(b"[" + b" " * 65536)
            self.wfile.flush()
            time.sleep(30)
        except OSError:
            pass
        self.close_connection = True

    def reply_endless(self):
        """A chunked body of valid-looking JSON that never ends, until the client goes away."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"[" + b"[-0.5, 1, null], " * 4096
        try:
            while True:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass
        self.close_connection = True

    def reply(self, code, obj):
        if MODE in MALFORMED and code == 200 and self.path in ("/generate", "/v1/completions"):
            obj = mangle(obj)
        body = json.dumps(obj).encode()
        if MODE == "notjson" and self.path in ("/generate", "/v1/completions"):
            body = body[: len(body) // 2]
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
        if MODE == "hugelength":
            return self.reply_huge()
        if MODE == "endless":
            return self.reply_endless()
        too_long = self.too_long(req)
        if too_long:
            return self.reply(400, {"object": "error", "message": too_long})
        if self.path == "/generate":
            return self.sglang(req)
        if self.path == "/v1/completions":
            return self.vllm(req)
        self.reply(404, {"error": "no such path"})

    def too_long(self, req):
        """vLLM's and SGLang's refusal of a sequence that leaves no room for one token."""
        seqs = req.get("input_ids") or req.get("prompt") or []
        for seq in seqs:
            if len(seq) >= SCORER.max_len:
                return (f"This model's maximum context length is {SCORER.max_len} tokens. However, "
                        f"you requested {len(seq) + 1} tokens ({len(seq)} in the messages, 1 in "
                        "the completion).")
        return None

    def tokenize(self, req):
        if ARGS.tokenize_log:
            with RECORD_LOCK, open(ARGS.tokenize_log, "a") as f:
                f.write(self.path + "\n")
        if ARGS.tokenize_status:
            with TOKENIZE_LOCK:
                fail = TOKENIZE_FAILURES[0] != 0
                if TOKENIZE_FAILURES[0] > 0:
                    TOKENIZE_FAILURES[0] -= 1
            if fail:
                return self.reply(ARGS.tokenize_status, {"error": "tokenize refused"})
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
        if MODE == "notemp":
            temperature = 1.0
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
        if ARGS.max_logprobs is not None and k > ARGS.max_logprobs:
            return self.reply(400, {"object": "error", "message":
                                    f"Requested prompt logprobs of {k}, which is greater than "
                                    f"max allowed: {ARGS.max_logprobs}"})
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
