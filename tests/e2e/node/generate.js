// A Node.js client of tandem.v1.GenerationService (@grpc/grpc-js + @grpc/proto-loader), for the e2e test.
//
//   node generate.js HOST:PORT '[{"token_ids": [1, 2], "sampling_params": {"temperature": 0}}, ...]'
//
// Each request object is a GenerateRequest in proto field names (its prompt as "text" or "token_ids").
// Runs them one after another and prints one JSON array: per request either
//   {"ok": true, "text", "token_ids", "finish_reason", "num_responses", "usage"}   or
//   {"ok": false, "code", "code_name", "message", "field_violations": [field paths], "reason"}
// where field_violations / reason come from decoding grpc-status-details-bin (google.rpc.Status with
// BadRequest / ErrorInfo details) with protobufjs.
//
// Security, from the environment: TANDEM_SSL_CA_CERTS (PEM CA bundle: connect with TLS, verifying the
// server against it), TANDEM_SSL_CERTFILE + TANDEM_SSL_KEYFILE (a client certificate for mutual TLS),
// TANDEM_API_KEY (sent as "authorization: Bearer <key>" on every call).
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTOS = path.resolve(__dirname, "..", "..", "..", "protos");

// The google.rpc messages this client decodes; `Any` is spelled out (same wire format).
const RPC_PROTO = `
syntax = "proto3";
package google.rpc;
message Any { string type_url = 1; bytes value = 2; }
message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
message BadRequest {
  message FieldViolation { string field = 1; string description = 2; }
  repeated FieldViolation field_violations = 1;
}
message ErrorInfo { string reason = 1; string domain = 2; map<string, string> metadata = 3; }
`;
const rpc = protobuf.parse(RPC_PROTO, { keepCase: true }).root;
const Status = rpc.lookupType("google.rpc.Status");
const BadRequest = rpc.lookupType("google.rpc.BadRequest");
const ErrorInfo = rpc.lookupType("google.rpc.ErrorInfo");

function loadService() {
  const definition = protoLoader.loadSync("tandem/v1/generation.proto", {
    keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true, includeDirs: [PROTOS],
  });
  return grpc.loadPackageDefinition(definition).tandem.v1.GenerationService;
}

function decodeDetails(metadata) {
  const out = { field_violations: [], reason: "" };
  const raw = metadata.get("grpc-status-details-bin");
  if (raw.length === 0) return out;
  const status = Status.decode(raw[0]);
  for (const any of status.details) {
    const type = any.type_url.slice(any.type_url.lastIndexOf("/") + 1);
    if (type === "google.rpc.BadRequest") {
      for (const v of BadRequest.decode(any.value).field_violations) out.field_violations.push(v.field);
    } else if (type === "google.rpc.ErrorInfo") {
      out.reason = ErrorInfo.decode(any.value).reason;
    }
  }
  return out;
}

function credentials() {
  const env = process.env;
  if (!env.TANDEM_SSL_CA_CERTS) return grpc.credentials.createInsecure();
  const read = (name) => (env[name] ? fs.readFileSync(env[name]) : null);
  return grpc.credentials.createSsl(read("TANDEM_SSL_CA_CERTS"), read("TANDEM_SSL_KEYFILE"),
                                    read("TANDEM_SSL_CERTFILE"));
}

function callMetadata() {
  const metadata = new grpc.Metadata();
  if (process.env.TANDEM_API_KEY) metadata.set("authorization", `Bearer ${process.env.TANDEM_API_KEY}`);
  return metadata;
}

function generate(client, request) {
  return new Promise((resolve) => {
    const result = { ok: true, text: "", token_ids: [], finish_reason: "", num_responses: 0, usage: null };
    const call = client.Generate(request, callMetadata());
    call.on("data", (response) => {
      result.num_responses += 1;
      result.text += response.text;
      result.token_ids.push(...response.token_ids);
      if (response.finish_reason && response.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
        result.finish_reason = response.finish_reason;
        result.usage = response.usage;
      }
    });
    call.on("error", (error) => {
      resolve({ ok: false, code: error.code, code_name: grpc.status[error.code], message: error.details,
                ...decodeDetails(error.metadata) });
    });
    call.on("end", () => resolve(result));
  });
}

async function main() {
  const [address, spec] = process.argv.slice(2);
  if (!address || !spec) {
    console.error("usage: node generate.js HOST:PORT '<JSON array of GenerateRequest objects>'");
    process.exit(2);
  }
  const GenerationService = loadService();
  const client = new GenerationService(address, credentials());
  const results = [];
  for (const request of JSON.parse(spec)) {
    if (request.token_ids) request.token_ids = { ids: request.token_ids };
    results.push(await generate(client, request));
  }
  client.close();
  process.stdout.write(JSON.stringify(results) + "\n");
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
