// A Node.js client of vLLM's native gRPC API (vllm.Inference, vllm.Control; @grpc/grpc-js + @grpc/proto-loader
// loading the vendored protos/tandem/vendor/vllm/*.proto as they are), for the e2e test.
//
//   node vllm_generate.js HOST:PORT '[{"op": "stream", "request": {...}}, ...]'
//
// Ops, run one after another, one JSON result each (printed as one array):
//   {"op": "stream", "request": GenerateRequest}  GenerateStream; per sequence index: text, token_ids,
//       logprobs, ranks, candidate ids, finish_reason, the stop reason, num_output_tokens, num_responses;
//       and prompt_tokens (from the first response's prompt_info)
//   {"op": "unary", "request": GenerateRequest}   Generate; the same fields for the one sequence
//   {"op": "abort", "request": GenerateRequest}   GenerateStream, Control.Abort of its request_id after
//       the first output, then the stream to its end: as "stream"
//   {"op": "server_info"}                         Control.GetServerInfo and Control.GetModelInfo
// A failed call is {"ok": false, "code", "code_name", "message", "field_violations": [field paths]}
// (google.rpc.Status + BadRequest from grpc-status-details-bin, decoded with protobufjs).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTOS = path.resolve(__dirname, "..", "..", "..", "protos", "tandem", "vendor", "vllm");

const RPC_PROTO = `
syntax = "proto3";
package google.rpc;
message Any { string type_url = 1; bytes value = 2; }
message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
message BadRequest {
  message FieldViolation { string field = 1; string description = 2; }
  repeated FieldViolation field_violations = 1;
}
`;
const rpc = protobuf.parse(RPC_PROTO, { keepCase: true }).root;
const Status = rpc.lookupType("google.rpc.Status");
const BadRequest = rpc.lookupType("google.rpc.BadRequest");

function loadPackage() {
  const definition = protoLoader.loadSync(["inference.proto", "control.proto"], {
    keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true, includeDirs: [PROTOS],
  });
  return grpc.loadPackageDefinition(definition).vllm;
}

function failure(error) {
  const out = { ok: false, code: error.code, code_name: grpc.status[error.code], message: error.details,
                field_violations: [] };
  const raw = error.metadata ? error.metadata.get("grpc-status-details-bin") : [];
  if (raw.length === 0) return out;
  for (const any of Status.decode(raw[0]).details) {
    if (any.type_url.endsWith("/google.rpc.BadRequest")) {
      for (const v of BadRequest.decode(any.value).field_violations) out.field_violations.push(v.field);
    }
  }
  return out;
}

function fold(result, response) {
  result.num_responses += 1;
  if (response.prompt_info) result.prompt_tokens = response.prompt_info.num_prompt_tokens;
  const output = response.outputs;
  if (!output) return;
  const key = String(output.index);
  const seq = result.sequences[key] || (result.sequences[key] = {
    text: "", token_ids: [], logprobs: [], ranks: [], candidates: [], num_tokens: 0, num_responses: 0,
    finish_reason: "NOT_FINISHED", stop_reason: null, num_output_tokens: 0,
  });
  seq.num_responses += 1;
  seq.text += output.text;
  seq.num_tokens += output.num_tokens;
  seq.token_ids.push(...output.token_ids);
  seq.logprobs.push(...output.logprobs);
  seq.ranks.push(...output.ranks);
  for (const position of output.candidate_tokens) seq.candidates.push(position.tokens.map((t) => t.id));
  if (output.finish_info) {
    const info = output.finish_info;
    seq.finish_reason = info.finish_reason;
    seq.num_output_tokens = info.num_output_tokens;
    if (info.stop_reason) seq.stop_reason = { [info.stop_reason]: info[info.stop_reason] };
  }
}

function stream(inference, control, request, abortAfterFirst) {
  return new Promise((resolve) => {
    const result = { ok: true, prompt_tokens: 0, num_responses: 0, sequences: {}, aborted: false };
    const call = inference.GenerateStream(request);
    call.on("data", (response) => {
      fold(result, response);
      if (abortAfterFirst && response.outputs && !result.aborted) {
        result.aborted = true;
        control.Abort({ request_ids: [request.request_id] }, (error) => {
          if (error) result.abort_error = failure(error);
        });
      }
    });
    call.on("error", (error) => resolve(failure(error)));
    call.on("end", () => resolve(result));
  });
}

function unary(client, method, request) {
  return new Promise((resolve) => {
    client[method](request, (error, response) => resolve(error ? failure(error) : { ok: true, response }));
  });
}

async function run(inference, control, op) {
  const request = op.request || {};
  if (request.token_ids) request.token_ids = { ids: request.token_ids };
  if (op.op === "stream") return stream(inference, control, request, false);
  if (op.op === "abort") return stream(inference, control, request, true);
  if (op.op === "unary") {
    const answer = await unary(inference, "Generate", request);
    if (!answer.ok) return answer;
    const result = { ok: true, prompt_tokens: 0, num_responses: 0, sequences: {} };
    fold(result, answer.response);
    return result;
  }
  if (op.op === "server_info") {
    const server = await unary(control, "GetServerInfo", {});
    const model = await unary(control, "GetModelInfo", {});
    return { ok: server.ok && model.ok, server: server.response, model: model.response };
  }
  throw new Error(`unknown op ${op.op}`);
}

async function main() {
  const [address, spec] = process.argv.slice(2);
  if (!address || !spec) {
    console.error("usage: node vllm_generate.js HOST:PORT '<JSON array of ops>'");
    process.exit(2);
  }
  const vllm = loadPackage();
  const inference = new vllm.Inference(address, grpc.credentials.createInsecure());
  const control = new vllm.Control(address, grpc.credentials.createInsecure());
  const results = [];
  for (const op of JSON.parse(spec)) results.push(await run(inference, control, op));
  inference.close();
  control.close();
  process.stdout.write(JSON.stringify(results) + "\n");
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
