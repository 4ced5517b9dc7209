// A gRPC load client for bench/frontend_capacity.py (`--apis grpc-node`): @grpc/grpc-js under Node
// (the package `make install` puts in node_modules for the cross-language e2e test), to see how much of
// the gRPC rows is the Python grpc.aio client's CPU rather than the frontend's.
//
// Reads jobs, one JSON line each on stdin: {"address": "host:port", "streams": N, "payload": base64 of a
// serialized tandem.v1.GenerateRequest}. Runs the N Generate streams at once on one channel, keeping each
// response as raw bytes (no protobuf decoding), and answers one JSON line: {"messages": responses
// received, "cpu_s": this process's user + system CPU during the job, "lasts": base64 of each stream's
// last response (the caller reads the usage from it)} or {"error": "..."}.
"use strict";

const grpc = require("@grpc/grpc-js");
const readline = require("readline");

const METHOD = "/tandem.v1.GenerationService/Generate";
const identity = (bytes) => bytes;

function run(job) {
  const payload = Buffer.from(job.payload, "base64");
  const client = new grpc.Client(job.address, grpc.credentials.createInsecure(),
                                 { "grpc.max_receive_message_length": -1 });
  const base = process.cpuUsage();
  const lasts = [];
  let pending = job.streams, messages = 0, failed = false;
  for (let i = 0; i < job.streams; i++) {
    let last = null;
    const call = client.makeServerStreamRequest(METHOD, identity, identity, payload);
    call.on("data", (message) => { last = message; messages++; });
    call.on("error", (error) => {
      if (!failed) {
        failed = true;
        client.close();
        process.stdout.write(JSON.stringify({ error: `${error.code}: ${error.details}` }) + "\n");
      }
    });
    call.on("end", () => {
      lasts.push(last === null ? "" : last.toString("base64"));
      if (--pending === 0 && !failed) {
        client.close();
        const cpu = process.cpuUsage(base);
        process.stdout.write(JSON.stringify({ messages, cpu_s: (cpu.user + cpu.system) / 1e6, lasts }) + "\n");
      }
    });
  }
}

readline.createInterface({ input: process.stdin }).on("line", (line) => run(JSON.parse(line)));
