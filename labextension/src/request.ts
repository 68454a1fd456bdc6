/**
 * requestAPI: the one way the panel talks to the server extension (`{baseUrl}/tfdist/api/...`).
 * ServerConnection adds the XSRF token and the auth header, so POST /stop passes jupyter_server's checks.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export async function requestAPI<T>(endPoint = '', init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'tfdist', 'api', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  let data: any = text;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      // not JSON: keep the text for the error message
    }
  }
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, data?.message || text);
  }
  return data as T;
}
