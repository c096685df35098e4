// A SpeechService client written against proto/ with @grpc/grpc-js and
// @grpc/proto-loader only: nothing from rtmedia's own code.
// Usage: node speech_client.js HOST:PORT INPUT.pcm RATE
// Prints one JSON object: voices, synthesis summary, transcripts.
'use strict';
const path = require('path');
const fs = require('fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [target, pcmPath, rateArg] = process.argv.slice(2);
const protoRoot = path.resolve(__dirname, '../../../proto');
const definition = protoLoader.loadSync('rtmedia/v1/speech.proto', {
  includeDirs: [protoRoot], keepCase: true, longs: Number, enums: String, defaults: true,
});
const v1 = grpc.loadPackageDefinition(definition).rtmedia.v1;
const client = new v1.SpeechService(target, grpc.credentials.createInsecure());

function listVoices() {
  return new Promise((resolve, reject) =>
    client.ListVoices({}, (err, reply) => (err ? reject(err) : resolve(reply))));
}

function synthesize(text) {
  return new Promise((resolve, reject) => {
    const summary = { chunks: 0, bytes: 0, sample_rate: 0, texts: [], final: false };
    const call = client.Synthesize({ text, sample_rate: 16000, framing: 'AUDIO_FRAMING_PCM16' });
    call.on('data', (r) => {
      summary.chunks += 1;
      summary.bytes += r.audio.length;
      summary.sample_rate = r.sample_rate;
      summary.texts.push(r.text);
      summary.final = r.is_final;
    });
    call.on('error', reject);
    call.on('end', () => resolve(summary));
  });
}

function transcribe(pcm, rate) {
  return new Promise((resolve, reject) => {
    const results = [];
    const call = client.Transcribe();
    call.on('data', (r) => results.push({ is_final: r.is_final, text: r.text, start_ms: r.start_ms, end_ms: r.end_ms }));
    call.on('error', reject);
    call.on('end', () => resolve(results));
    call.write({ config: { audio_format: { encoding: 'AUDIO_ENCODING_PCM16', sample_rate: rate, channels: 1 } } });
    const step = (rate / 10) * 2; // 100 ms
    for (let i = 0; i < pcm.length; i += step) call.write({ audio: pcm.subarray(i, i + step) });
    call.end();
  });
}

function badRate() {
  return new Promise((resolve) => {
    const call = client.Synthesize({ text: 'hi', sample_rate: 7 });
    call.on('data', () => {});
    call.on('error', (err) => resolve({ code: err.code, details: err.details }));
    call.on('end', () => resolve({ code: 0 }));
  });
}

(async () => {
  const voices = await listVoices();
  const synth = await synthesize('Hello from Node. This stream was requested by grpc-js.');
  const transcripts = await transcribe(fs.readFileSync(pcmPath), Number(rateArg));
  const error = await badRate();
  console.log(JSON.stringify({ voices: voices.voices.map((v) => v.name), synth, transcripts, error }));
  client.close();
})().catch((err) => {
  console.error(`interop client failed: ${err.message}`);
  process.exit(1);
});
