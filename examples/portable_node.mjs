// Train with onnxruntime-node: loop a step model onnxtrain exported. Run it from a folder
// where `npm install onnxruntime-node` was run (ES modules ignore NODE_PATH).
//
//   node portable_node.mjs model.step.onnx batches.json trained.json [steps]
//
// batches.json: [{"<feed>": {"type": "float32", "dims": [...], "data": [...]}, ...}, ...].
// The state starts from the initializers the manifest names; each step's new state is fed back.
import { readFileSync, writeFileSync } from "node:fs";
import ort from "onnxruntime-node";

// onnxruntime-node exposes neither metadata_props nor initializers: a minimal protobuf walk
// reads them (ModelProto: graph 7, metadata_props 14; GraphProto: initializer 5).
function fields(bytes, start, end, visit) {
  let i = start;
  const varint = () => { let v = 0, scale = 1, b; do { b = bytes[i++]; v += (b & 127) * scale; scale *= 128; } while (b & 128); return v; };
  while (i < end) {
    const tag = varint(), wire = tag & 7;
    if (wire === 0) visit(tag >>> 3, varint()); else if (wire === 1) i += 8; else if (wire === 5) i += 4;
    else if (wire === 2) { const n = varint(); visit(tag >>> 3, i, i + n); i += n; }
    else throw new Error(`wire type ${wire}: not an ONNX model`);
  }
}
const text = (bytes, s, e) => bytes.subarray(s, e).toString("utf8");
const TYPES = { 1: ["float32", Float32Array], 7: ["int64", BigInt64Array], 11: ["float64", Float64Array], 6: ["int32", Int32Array] };
function tensorProto(bytes, s, e) {  // dims 1, data_type 2, name 8, raw_data 9 (onnxtrain writes raw_data)
  const t = { dims: [] };
  fields(bytes, s, e, (f, a, b) => {
    if (f === 1) t.dims.push(a);  // onnx and onnxtrain write dims unpacked
    else if (f === 2) t.type = a; else if (f === 8) t.name = text(bytes, a, b);
    else if (f === 9) t.raw = bytes.subarray(a, b);
  });
  return t;
}
function readModel(bytes) {
  const meta = {}, stored = {};
  fields(bytes, 0, bytes.length, (f, s, e) => {
    if (f === 14) { const kv = {}; fields(bytes, s, e, (g, a, b) => { kv[g] = text(bytes, a, b); }); meta[kv[1]] = kv[2]; }
  });
  const manifest = JSON.parse(meta["onnxtrain.step"]), wanted = new Set(Object.values(manifest.initial));
  fields(bytes, 0, bytes.length, (f, s, e) => {
    if (f === 7) fields(bytes, s, e, (g, a, b) => {
      if (g !== 5) return;
      const t = tensorProto(bytes, a, b);
      if (!wanted.has(t.name)) return;
      if (!(t.type in TYPES) || !t.raw) throw new Error(`${t.name}: element type ${t.type} without raw_data`);
      const [type, Typed] = TYPES[t.type];
      stored[t.name] = new ort.Tensor(type, new Typed(Uint8Array.from(t.raw).buffer), t.dims);
    });
  });
  return [manifest, stored];
}
const tensor = ({ type, dims, data }) =>
  new ort.Tensor(type, type === "int64" ? BigInt64Array.from(data, BigInt) : Float32Array.from(data), dims);
const plain = (t) => ({ type: t.type, dims: t.dims, data: Array.from(t.data, Number) });

const [modelPath, batchesPath, outPath, steps = "20"] = process.argv.slice(2);
const bytes = readFileSync(modelPath);
const [manifest, stored] = readModel(bytes);
// No warning that nodes read no <name>.initial initializer: this loop does.
const session = await ort.InferenceSession.create(bytes, { logSeverityLevel: 3 });
const batches = JSON.parse(readFileSync(batchesPath, "utf8"));
const state = Object.fromEntries(Object.entries(manifest.initial).map(([name, init]) => [name, stored[init]]));
const losses = [];
for (let step = 0; step < Number(steps); step++) {
  const feeds = { ...state };
  for (const name of manifest.feeds) feeds[name] = tensor(batches[step % batches.length][name]);
  const results = await session.run(feeds);
  for (const [name, output] of manifest.state) state[name] = results[output];
  losses.push(Number(results[manifest.loss].data[0]));
  console.log(`step ${step + 1}: loss ${losses.at(-1).toFixed(6)}`);
}
const saved = Object.fromEntries(Object.entries(state).map(([name, t]) => [name, plain(t)]));
writeFileSync(outPath, JSON.stringify({ losses, state: saved }));
