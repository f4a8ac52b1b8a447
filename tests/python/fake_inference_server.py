"""A fake SGLang / vLLM server for tests/http_teacher_test.cc (stdlib only).

Usage: fake_inference_server.py PORT_FILE MODE
Binds 127.0.0.1:0, writes its port to PORT_FILE. MODE: ok | nan | minus9999 | short | reorder |
error500 | slow | drop. Log-probs are synthetic: token t at position p has log-prob
-(t % 7 + 1) / 10 (a known function the test checks against); top-k entries follow it.
"""
import json
import math
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE = sys.argv[2] if len(sys.argv) > 2 else "ok"


def lp(t):
    return -((t % 7) + 1) / 10.0


def top(k):
    # k most likely ids: 0, 7, 14, ... all with log-prob -0.1
    return [(-0.1, 7 * i) for i in range(k)]


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
            import socket
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
            return self.reply(200, {"model_path": "fake-sglang", "is_generation": True})
        if self.path == "/v1/models":
            return self.reply(200, {"data": [{"id": "fake-vllm", "object": "model"}]})
        self.reply(404, {"error": "no such path"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if MODE == "error500":
            return self.reply(500, {"error": "boom"})
        if MODE == "slow":
            time.sleep(3)
        if self.path == "/generate":
            return self.sglang(req)
        if self.path == "/v1/completions":
            return self.vllm(req)
        self.reply(404, {"error": "no such path"})

    def sglang(self, req):
        ids = req["input_ids"]
        starts = req["logprob_start_len"]
        k = req.get("top_logprobs_num", 0)
        out = []
        for seq, s in zip(ids, starts):
            tok = [None] + [[lp(t), t, "x"] for t in seq[s + 1:]]
            tok[0] = [None, seq[s], "x"]
            item = {"text": "", "meta_info": {"input_token_logprobs": tok}}
            if k:
                item["meta_info"]["input_top_logprobs"] = [None] + [
                    [[l, i, "x"] for l, i in top(k)] for _ in seq[s + 1:]]
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
            pl = [None]
            for t in seq[1:]:
                d = {str(i): {"logprob": l, "rank": r + 1, "decoded_token": "x"}
                     for r, (l, i) in enumerate(top(k))}
                if str(t) not in d:  # k + 1 entries: the sampled token outside the top k
                    d[str(t)] = {"logprob": lp(t), "rank": 100, "decoded_token": "x"}
                pl.append(d)
            choices.append({"index": n, "text": "", "prompt_logprobs": pl})
        if MODE == "minus9999":
            first = choices[0]["prompt_logprobs"][-1]
            for v in first.values():
                v["logprob"] = -9999.0
        if MODE == "reorder":
            choices.reverse()
        if MODE == "short":
            choices.pop()
        body = json.dumps({"choices": choices}).replace("NaN", "NaN")
        self.reply(200, json.loads(body))


srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(srv.server_address[1]))
import os
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
srv.serve_forever()
