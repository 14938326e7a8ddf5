#!/usr/bin/env node
// A Tandem client written only from the public API (proto/tandem/v1/tandem.proto), with none of
// Tandem's own code: it calls Generate once and prints each streamed response as one JSON line.
//
//   node generate.js '{"text": "Hello", "sampling": {"max_tokens": 4}}'
//   node generate.js '{"token_ids": {"ids": [1, 2]}, "sampling": {"max_tokens": 4}}'
//
// Environment: TANDEM_ADDR (default 127.0.0.1:50051), TANDEM_TOKEN (sent as
// "authorization: Bearer <token>"), TANDEM_TLS_CA (a PEM file: connect with TLS verified by it).
// Field names are kept as in the proto (snake_case); 64-bit integers are Numbers; unset fields
// appear with their defaults.
// Exit status: 0 at the end of the stream; 2 on a gRPC error, after printing
// {"error": {"code": <number>, "details": "..."}}; 1 on a usage error.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.join(__dirname, '..', '..', 'proto');

function usage(message) {
  process.stderr.write(`generate.js: ${message}\n` +
    'usage: node generate.js \'<GenerateRequest as JSON>\'  (env: TANDEM_ADDR, TANDEM_TOKEN, TANDEM_TLS_CA)\n');
  process.exit(1);
}

function main() {
  if (process.argv.length < 3) usage('missing the request');
  let request;
  try {
    request = JSON.parse(process.argv[2]);
  } catch (err) {
    usage(`the request is not valid JSON: ${err.message}`);
  }
  if (request === null || typeof request !== 'object' || Array.isArray(request)) {
    usage('the request must be a JSON object');
  }

  const definition = protoLoader.loadSync('tandem/v1/tandem.proto', {
    includeDirs: [PROTO_DIR],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const tandem = grpc.loadPackageDefinition(definition).tandem.v1;

  const address = process.env.TANDEM_ADDR || '127.0.0.1:50051';
  const credentials = process.env.TANDEM_TLS_CA
    ? grpc.credentials.createSsl(fs.readFileSync(process.env.TANDEM_TLS_CA))
    : grpc.credentials.createInsecure();
  const client = new tandem.Tandem(address, credentials);

  const metadata = new grpc.Metadata();
  if (process.env.TANDEM_TOKEN) metadata.add('authorization', `Bearer ${process.env.TANDEM_TOKEN}`);

  const call = client.Generate(request, metadata);
  call.on('data', (response) => {
    process.stdout.write(JSON.stringify(response) + '\n');
  });
  call.on('error', (err) => {
    process.stdout.write(JSON.stringify({ error: { code: err.code, details: err.details } }) + '\n');
    process.exitCode = 2;
    client.close();
  });
  call.on('status', (status) => {
    if (status.code === grpc.status.OK) process.exitCode = 0;
    client.close();
  });
}

main();
